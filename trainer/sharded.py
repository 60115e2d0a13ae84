"""A policy sharded over N Ray workers: FSDP2 ranks of one torch.distributed group
(``policy.num_workers`` > 1), forming ``policy.replicas`` data-parallel replicas (HSDP).

Each :class:`PolicyRank` actor holds its shard of the model and of the AdamW state, trains on
its part of each batch and saves its own shards through ``ckptstore.integrations.dcp`` in the
background (``save_shards``: uploads only, on a process group of their own so the upload's
collectives never interleave with training's). The controller never sees a shard: it talks to a
:class:`PolicyGroup`, which offers the single policy worker's calls (``await
group.train_step.remote(batch)``, ...) and fans each out to every rank. The receipts of a save
come back through rank 0, and the controller commits them with the replay buffer and its own
state in one transaction. Loads are planned by the controller (it alone opens the manifest) and
read by every rank from the store: a worker never touches the database. With R replicas the
ranks of different replicas hold the same shards: a save stores each once (DCP writes a
replicated item from one rank) and a load reads each blob from the store once, the rank that
read it sending it to the others (``ckpt_dcp.load``'s read-once ``share``).
"""

from __future__ import annotations

import asyncio
import socket
import warnings
from collections.abc import Awaitable, Callable
from concurrent.futures import Future
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
from tensordict import TensorDict
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
)
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard

from ckptstore import IntegrityError, ShardReceipt
from ckptstore.extending import ObjectStore, TierConfig, writer_store
from ckptstore.integrations import dcp as ckpt_dcp
from trainer.config import TrainerConfig
from trainer.errors import TrainerError
from trainer.policy import Policy
from trainer.policy_state import (
    TierSources,
    apply_whole_state,
    load_sharded,
    sharded_state,
    whole_fits,
)
from trainer.tiering import check_nonce, on_this_node, tier_node
from trainer.workers import TrainStats, grpo_objective, policy_config

#: Seconds a clean close waits for the ranks before they are killed.
CLOSE_SECONDS = 30.0
#: Seconds the ranks may take to be placed and started. Not policy.collective_timeout_s: a new
#: worker process imports torch and builds the model, which takes tens of seconds on a busy
#: node; a cluster that can never hold the ranks is refused at once (_check_resources).
PLACE_SECONDS = 300.0
#: How long a background upload's collectives wait for the slowest rank's upload. Not
#: policy.collective_timeout_s: uploads of a large model legitimately take minutes and a store
#: may stall for a while; a rank that is gone is found by the controller (its calls fail) and
#: the survivors are killed, which ends their waits.
UPLOAD_TIMEOUT = timedelta(hours=1)


class PolicyRank:
    """Rank ``rank`` of ``world``: its shard of the policy and of the optimizer, trained with
    FSDP2 over gloo (``cpu:gloo,cuda:nccl`` where CUDA is present). With ``policy.replicas``
    R > 1 the ranks form an R x (world / R) mesh: rank r is shard r % (world / R) of replica
    r // (world / R), and gradients are averaged over every rank (HSDP)."""

    def __init__(
        self,
        cfg: TrainerConfig,
        base_weights: dict[str, torch.Tensor],
        store: str | None,
        rank: int,
        world: int,
    ) -> None:
        torch.set_num_threads(1)
        torch.manual_seed(cfg.seed)
        # The policy's logits are a view (a Linear over [batch, length, width]); nothing here
        # changes them in place, which is what FSDP2's warning about views is for.
        warnings.filterwarnings("ignore", message=".*returned a view tensor", category=UserWarning)
        self.cfg = cfg
        self.rank = rank
        self.world = world
        self.store = store
        config = policy_config(cfg)
        self.model = Policy(config)
        self.model.load_state_dict(base_weights)
        self.reference = Policy(config).eval().requires_grad_(False)
        self.reference.load_state_dict(base_weights)
        self.optimizer: torch.optim.Optimizer | None = None
        self.checkpoint_group: dist.ProcessGroup | None = None
        self.stager = ckpt_dcp.SnapshotStager()
        self._save: Future[list[ShardReceipt]] | None = None
        #: The node-local tiers saves go through (use_tiers), else the store.
        self.tiers: TierConfig | None = None
        self._tier_store: ObjectStore | None = None

    def node(self) -> str:
        """The Ray node this rank runs on."""
        import ray

        return str(ray.get_runtime_context().get_node_id())

    def tier_node(self) -> tuple[str, str | None]:
        """This rank's node: its tier name and its Ray node id."""
        return tier_node()

    def use_tiers(self, tiers: TierConfig) -> None:
        """Save through the node-local tiers from now on (this rank's node, its peers)."""
        self.tiers = on_this_node(tiers)
        self._tier_store = writer_store(self.tiers)

    def check_store(self, key: str, nonce: str) -> None:
        """The controller's nonce is in the store as this rank's node sees it."""
        assert self.store is not None
        check_nonce(self.store, key, nonce)

    def rendezvous(self) -> str:
        """(Rank 0) where the group meets: this node's address and a free port."""
        import ray

        host = ray.util.get_node_ip_address()  # type: ignore[no-untyped-call]
        with socket.socket() as probe:
            probe.bind((host, 0))
            port = probe.getsockname()[1]
        return f"tcp://{host}:{port}"

    def join(self, address: str) -> None:
        """Join the group at ``address`` and shard the model (every rank at once)."""
        timeout = timedelta(seconds=self.cfg.policy.collective_timeout_s)
        backend = "cpu:gloo,cuda:nccl" if torch.cuda.is_available() else "gloo"
        dist.init_process_group(
            backend, init_method=address, rank=self.rank, world_size=self.world, timeout=timeout
        )
        # Background uploads run their collectives here, never on training's group.
        self.checkpoint_group = dist.new_group(backend="gloo", timeout=UPLOAD_TIMEOUT)
        replicas = self.cfg.policy.replicas
        mesh = (
            init_device_mesh(
                "cpu", (replicas, self.world // replicas), mesh_dim_names=("replicate", "shard")
            )
            if replicas > 1
            else init_device_mesh("cpu", (self.world,))
        )
        for block in self.model.blocks:
            fully_shard(block, mesh=mesh)
        fully_shard(self.model, mesh=mesh)
        self.optimizer = torch.optim.AdamW(self.model.parameters(), lr=self.cfg.policy.lr)

    def _optim(self) -> torch.optim.Optimizer:
        if self.optimizer is None:
            raise RuntimeError("policy rank used before join()")
        return self.optimizer

    def train_step(self, batch: TensorDict, weight: float) -> TrainStats:
        """This rank's part of a GRPO step: its groups' loss, weighted by their share of the
        batch (``weight``; 0 for a rank with no groups this step, which still takes part in
        the collectives) so that the gradients FSDP averages are those of the whole batch."""
        optimizer = self._optim()
        self.model.train()
        loss, stats = grpo_objective(self.cfg, self.model, self.reference, batch)
        optimizer.zero_grad(set_to_none=True)
        torch.autograd.backward(loss * (weight * self.world))
        grad_norm = torch.nn.utils.clip_grad_norm_(self.model.parameters(), 1.0)
        optimizer.step()
        return TrainStats(
            loss=stats.loss,
            grad_norm=float(grad_norm),
            tokens=stats.tokens if weight > 0 else 0,
            kl=stats.kl,
            clip_frac=stats.clip_frac,
        )

    def weights(self) -> dict[str, torch.Tensor]:
        """The whole model on rank 0 (gathered from every rank), {} on the others."""
        options = StateDictOptions(full_state_dict=True, cpu_offload=True)
        whole: dict[str, torch.Tensor] = get_model_state_dict(self.model, options=options)  # type: ignore[assignment]
        return whole

    def whole_state(self) -> dict[str, Any]:
        """The whole model and optimizer state (keyed by name) on rank 0, gathered from every
        rank; {} on the others. For inspection and export: a save never gathers."""
        options = StateDictOptions(full_state_dict=True, cpu_offload=True)
        model = get_model_state_dict(self.model, options=options)
        optim = get_optimizer_state_dict(self.model, self._optim(), options=options)
        return {"model": model, "optim": optim} if self.rank == 0 else {}

    def snapshot_shards(self, save_optimizer: bool) -> None:
        """Copy this rank's shards into reused host buffers and upload them in the background."""
        if self.store is None:
            raise RuntimeError("this policy rank was started without a checkpoint store")
        if self._save is not None:
            raise RuntimeError("snapshot_shards() before the previous save's receipts were taken")
        state = sharded_state(self.model, self._optim(), save_optimizer)
        upload = ckpt_dcp.save_shards(
            state,
            self._tier_store if self._tier_store is not None else self.store,
            process_group=self.checkpoint_group,
            async_save=True,
            stager=self.stager,
        )
        assert isinstance(upload, Future)
        self._save = upload

    def upload_done(self) -> bool:
        """Whether the last snapshot's upload has finished (or failed)."""
        return self._save is not None and self._save.done()

    def shard_receipts(self) -> list[ShardReceipt]:
        """Wait for the last snapshot's upload: every receipt of the save on rank 0 (the
        ranks' components and DCP's metadata), [] on the others; raises its ``SaveError``."""
        save, self._save = self._save, None
        if save is None:
            raise RuntimeError("shard_receipts() without a snapshot_shards() first")
        return save.result()

    def load_whole(self, policy: dict[str, torch.Tensor], optimizer: dict[str, Any] | None) -> bool:
        """Take this rank's shard of a policy saved whole; False, changing nothing, if it does
        not fit the model."""
        if not whole_fits(self.model, policy):
            return False
        apply_whole_state(self.model, self._optim(), policy, optimizer)
        return True

    def load_sharded(
        self, plan: ckpt_dcp.LoadPlan, with_optimizer: bool, sources: TierSources | None = None
    ) -> dict[str, int]:
        """Read this rank's shard of a sharded checkpoint (any number of saving ranks); with
        ``sources``, each blob from its nearest copy on the node-local tiers. Replicas share
        their reads: each blob comes from the store once, to one rank. Returns the bytes this
        rank read from the store and from each tier."""
        if self.store is None:
            raise RuntimeError("this policy rank was started without a checkpoint store")
        # Replicas want the same blobs; on one node's own disk (auto: off) reading them again
        # may be cheaper, but replicas are spread over nodes that share one store.
        share = True if self.cfg.policy.replicas > 1 else None
        return load_sharded(
            self.model,
            self._optim(),
            plan,
            with_optimizer,
            self.store,
            self.tiers,
            sources,
            share=share,
        )

    def close(self) -> None:
        """Wait for an upload nobody collected, then leave the group."""
        save, self._save = self._save, None
        try:
            if save is not None:
                save.result()
        finally:
            self.stager.release()
            if self._tier_store is not None:
                self._tier_store.close()
            if dist.is_initialized():
                dist.destroy_process_group()


def _check_resources(world: int, each: dict[str, float]) -> None:
    """Refuse at once ranks that the whole cluster could never hold (what is free is only
    known by trying: :meth:`PolicyGroup.start` waits for that)."""
    import ray

    total = ray.cluster_resources()  # type: ignore[no-untyped-call]
    short = {k: v * world for k, v in each.items() if total.get(k, 0.0) < v * world}
    if short:
        have = {k: total.get(k, 0.0) for k in short}
        raise TrainerError(
            f"policy.num_workers={world} with policy.worker_resources={each} needs {short} in "
            f"all, but the Ray cluster has {have}: lower policy.num_workers, change "
            "policy.worker_resources or add nodes with those resources"
        )


class _Call:
    """``group.method.remote(...)``: the spelling the controller uses for every worker."""

    def __init__(self, method: Callable[..., Awaitable[Any]]) -> None:
        self.remote = method


class PolicyGroup:
    """N :class:`PolicyRank` actors behind the calls of one policy worker."""

    def __init__(self, cfg: TrainerConfig, ranks: list[Any], nodes: list[str]) -> None:
        self.cfg = cfg
        self.ranks = ranks
        #: The Ray node of each rank.
        self.nodes = nodes
        #: A rank failed (or died): close kills the actors instead of asking them.
        self.broken = False
        #: The bytes the last load_sharded read from the store and each tier, all ranks'.
        self.last_read: dict[str, int] = {}
        self.train_step = _Call(self._train_step)
        self.weights = _Call(self._weights)
        self.whole_state = _Call(self._whole_state)
        self.snapshot_shards = _Call(self._snapshot_shards)
        self.shard_receipts = _Call(self._shard_receipts)
        self.load = _Call(self._load)
        self.load_sharded = _Call(self._load_sharded)
        self.tier_node = _Call(self._tier_node)
        self.use_tiers = _Call(self._use_tiers)
        self.check_store = _Call(self._check_store)
        self.close = _Call(self._close)

    @classmethod
    async def start(
        cls, cfg: TrainerConfig, base_weights: dict[str, torch.Tensor], store: str | None
    ) -> PolicyGroup:
        """Place the ranks (each with ``policy.worker_resources``), form the group, shard."""
        import ray

        world = cfg.policy.num_workers
        options: dict[str, Any] = {"num_cpus": 0}
        if cfg.policy.worker_resources:
            options["resources"] = dict(cfg.policy.worker_resources)
        _check_resources(world, options.get("resources", {}))
        weights = ray.put(base_weights)
        actor = ray.remote(**options)(PolicyRank)
        ranks: list[Any] = [actor.remote(cfg, weights, store, rank, world) for rank in range(world)]
        group = cls(cfg, ranks, [])
        wait = PLACE_SECONDS
        try:
            nodes = await asyncio.wait_for(
                asyncio.gather(*(rank.node.remote() for rank in ranks)), wait
            )
        except TimeoutError:
            group.broken = True
            await group._close()
            raise TrainerError(
                f"the {world} policy workers could not all be placed and started within "
                f"{wait:.0f} s: the Ray cluster lacks free resources for them (each asks for "
                f"{options.get('resources') or 'no custom resources'}); lower "
                "policy.num_workers, change policy.worker_resources or add nodes"
            ) from None
        group.nodes = list(nodes)
        address = await group._all([ranks[0].rendezvous.remote()])
        await group._all([rank.join.remote(address[0]) for rank in ranks])
        return group

    async def _all(self, calls: list[Any]) -> list[Any]:
        """Every rank's answer; the first failure marks the group broken and is raised, as a
        TrainerError naming the lost ranks when some rank is gone (the survivors' collectives
        usually fail first, with errors that do not say why). Damage a load found
        (``IntegrityError``) is raised by every rank together and leaves the group whole."""
        try:
            return list(await asyncio.gather(*calls))
        except IntegrityError:
            raise
        except Exception as exc:
            self.broken = True
            lost = await self._lost_ranks()
            if not lost:
                raise
            where = ", ".join(f"rank {r} on node {self.nodes[r][:12]}" for r in lost)
            raise TrainerError(
                f"policy worker(s) lost: {where} died or stopped answering (the group of "
                f"{len(self.ranks)} failed with {type(exc).__name__}); nothing they were saving "
                "is committed. Re-run the same command to resume from the last committed "
                "checkpoint, with a policy.num_workers the cluster can still place"
            ) from exc
        except BaseException:
            self.broken = True
            raise

    async def _lost_ranks(self) -> list[int]:
        """The ranks that are dead or do not answer within the collective timeout (plus a
        margin: a survivor answers once its own collective has failed)."""
        import ray

        wait = self.cfg.policy.collective_timeout_s + 10.0

        async def lost(rank: Any) -> bool:
            try:
                await asyncio.wait_for(rank.node.remote(), wait)
            except (ray.exceptions.RayActorError, TimeoutError):
                return True
            return False

        found = await asyncio.gather(*(lost(rank) for rank in self.ranks))
        return [r for r, gone in enumerate(found) if gone]

    async def _train_step(self, batch: TensorDict) -> TrainStats:
        """Split the batch's groups over the ranks (contiguous, as even as can be), train,
        and combine the ranks' stats weighted by their share of the batch."""
        size = self.cfg.grpo.num_generations_per_prompt
        rows = int(batch.batch_size[0])
        groups, world = rows // size, len(self.ranks)
        calls, weights, start = [], [], 0
        for rank, actor in enumerate(self.ranks):
            count = groups // world + (1 if rank < groups % world else 0)
            part = batch[start * size : (start + count) * size] if count else batch[:size]
            weight = count * size / rows
            calls.append(actor.train_step.remote(part, weight))
            weights.append(weight)
            start += count
        stats: list[TrainStats] = await self._all(calls)
        return TrainStats(
            loss=sum(w * s.loss for w, s in zip(weights, stats, strict=True)),
            grad_norm=stats[0].grad_norm,
            tokens=sum(s.tokens for s in stats),
            kl=sum(w * s.kl for w, s in zip(weights, stats, strict=True)),
            clip_frac=sum(w * s.clip_frac for w, s in zip(weights, stats, strict=True)),
        )

    async def _weights(self) -> dict[str, torch.Tensor]:
        parts = await self._all([rank.weights.remote() for rank in self.ranks])
        whole: dict[str, torch.Tensor] = parts[0]
        return whole

    async def _whole_state(self) -> dict[str, Any]:
        parts = await self._all([rank.whole_state.remote() for rank in self.ranks])
        whole: dict[str, Any] = parts[0]
        return whole

    async def _snapshot_shards(self, save_optimizer: bool) -> None:
        await self._all([rank.snapshot_shards.remote(save_optimizer) for rank in self.ranks])

    async def _shard_receipts(self, wait: bool) -> list[ShardReceipt] | None:
        """Every receipt of the last save (None if ``wait`` is false and a rank still
        uploads); a rank's failure is raised."""
        if not wait:
            done = await self._all([rank.upload_done.remote() for rank in self.ranks])
            if not all(done):
                return None
        parts = await self._all([rank.shard_receipts.remote() for rank in self.ranks])
        return [receipt for part in parts for receipt in part]

    async def _load(self, policy: dict[str, Any], optimizer: dict[str, Any] | None) -> bool:
        import ray

        refs = ray.put(policy), ray.put(optimizer)
        fits = await self._all([rank.load_whole.remote(*refs) for rank in self.ranks])
        return all(fits)

    async def _load_sharded(
        self, plan: ckpt_dcp.LoadPlan, with_optimizer: bool, sources: TierSources | None = None
    ) -> dict[str, int]:
        """Every rank reads its shard; the bytes they read from each source, summed."""
        reads: list[dict[str, int]] = await self._all(
            [rank.load_sharded.remote(plan, with_optimizer, sources) for rank in self.ranks]
        )
        total: dict[str, int] = {}
        for read in reads:
            for source, n in read.items():
                total[source] = total.get(source, 0) + n
        self.last_read = total
        return total

    async def _tier_node(self) -> list[tuple[str, str | None]]:
        """Every rank's node (tier name, Ray node id)."""
        return await self._all([rank.tier_node.remote() for rank in self.ranks])

    async def _use_tiers(self, tiers: TierConfig) -> None:
        await self._all([rank.use_tiers.remote(tiers) for rank in self.ranks])

    async def _check_store(self, key: str, nonce: str) -> None:
        await self._all([rank.check_store.remote(key, nonce) for rank in self.ranks])

    async def _close(self) -> None:
        """Leave the group cleanly (waiting for uploads nobody collected) when every rank is
        healthy; kill the actors in any case, so a rank stuck in a collective with a lost one
        never holds the run."""
        import ray

        try:
            if not self.broken:
                await asyncio.wait_for(
                    self._all([rank.close.remote() for rank in self.ranks]), CLOSE_SECONDS
                )
        finally:
            for rank in self.ranks:
                ray.kill(rank)
