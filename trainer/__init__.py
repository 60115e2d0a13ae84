"""A compact asynchronous GRPO trainer on Ray that checkpoints through ckptstore.

Run it with ``python -m trainer.grpo [--config file.yaml] [dotted.key=value ...]``; re-running the
same command resumes from the newest committed checkpoint.
"""

import warnings

# torchdata's StatefulDataLoader calls a torch API that now warns on every construction.
warnings.filterwarnings("ignore", message="'set_vital' is deprecated", category=UserWarning)
