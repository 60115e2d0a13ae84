/* How much heap a call allocates, from AddressSanitizer's allocator hooks: loaded with ctypes
   into a process that runs with libasan preloaded (which defines the __sanitizer_* symbols).

   The fuzz harness resets the probe before each decode and reads, after it, the most bytes
   that were allocated and not yet freed at any moment since: the decoder may allocate its
   declared output, one block of scratch and its code tables, never more, whatever a payload
   claims. Frees of blocks allocated before the reset count too (the net may dip below zero),
   which only makes the bound stricter. */
#include <stddef.h>

extern size_t __sanitizer_get_allocated_size(const volatile void *ptr);
extern int __sanitizer_install_malloc_and_free_hooks(void (*)(const volatile void *, size_t),
                                                     void (*)(const volatile void *));

static long long net, peak;

static void on_malloc(const volatile void *ptr, size_t size) {
    (void)ptr;
    net += (long long)size;
    if (net > peak) peak = net;
}

static void on_free(const volatile void *ptr) {
    net -= (long long)__sanitizer_get_allocated_size(ptr);
}

/* Nonzero once the hooks are in place. */
int probe_install(void) { return __sanitizer_install_malloc_and_free_hooks(on_malloc, on_free); }

/* Start a measurement. */
void probe_reset(void) { net = peak = 0; }

/* The most bytes held at once since the last reset, net of frees. */
long long probe_peak(void) { return peak; }
