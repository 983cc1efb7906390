"""How ranks are arranged: tensor-parallel attention, data-parallel attention groups, expert parallelism.

One engine spans `tp_size` ranks (the world). Attention and dense layers are split over the
ranks of an attention group (tp_size / dp_size ranks); with DP attention each of the dp_size
groups schedules its own requests. MoE layers either shard their experts over all ranks
(ep_size == tp_size, tokens travel through the dispatcher) or, with ep_size == 1, slice every
expert's intermediate dimension over the ranks (tensor-parallel experts, summed by all-reduce).
"""

from __future__ import annotations

import datetime

import attrs
import torch
import torch.distributed as dist


@attrs.frozen
class ParallelConfig:
    tp_size: int = 1
    ep_size: int = 1
    dp_size: int = 1
    enable_dp_attention: bool = False
    nnodes: int = 1
    node_rank: int = 0
    dist_init_addr: str = "127.0.0.1:29517"
    dist_backend: str | None = None  # None: nccl on CUDA, gloo on CPU
    timeout_s: float = 300.0

    def __attrs_post_init__(self):
        for name in ("tp_size", "ep_size", "dp_size", "nnodes"):
            if getattr(self, name) < 1:
                raise ValueError(f"--{name.replace('_', '-')} must be at least 1")
        if self.ep_size not in (1, self.tp_size):
            raise ValueError(
                f"--ep-size {self.ep_size} must be 1 (tensor-parallel experts) or equal to --tp-size {self.tp_size} "
                "(experts sharded over every rank)"
            )
        if self.dp_size > 1 and not self.enable_dp_attention:
            raise ValueError(
                "--dp-size > 1 needs --enable-dp-attention; for independent replicas run several servers behind `moeplex router`"
            )
        if self.tp_size % self.dp_size:
            raise ValueError(f"--dp-size {self.dp_size} must divide --tp-size {self.tp_size}")
        if self.enable_dp_attention and self.dp_size > 1 and self.ep_size != self.tp_size:
            raise ValueError("DP attention needs the experts sharded over every rank: set --ep-size equal to --tp-size")
        if self.tp_size % self.nnodes:
            raise ValueError(f"--nnodes {self.nnodes} must divide --tp-size {self.tp_size}")
        if not 0 <= self.node_rank < self.nnodes:
            raise ValueError(f"--node-rank must be in 0..{self.nnodes - 1}")
        if self.dist_backend not in (None, "gloo", "nccl"):
            raise ValueError(f"--dist-backend must be gloo or nccl, got {self.dist_backend!r}")

    @property
    def world_size(self) -> int:
        return self.tp_size

    @property
    def ranks_per_node(self) -> int:
        return self.tp_size // self.nnodes

    @property
    def attn_tp_size(self) -> int:
        return self.tp_size // self.dp_size

    @property
    def distributed(self) -> bool:
        return self.world_size > 1


@attrs.frozen
class Group:
    """One process group as this rank sees it (size 1 and group None when there is nothing to talk to).

    `group` carries the tensors of the forward pass (NCCL on GPUs); `host` carries the small
    host-side collectives that schedule steps (gloo, so they never touch or wait on a GPU).
    """

    rank: int = 0
    size: int = 1
    group: object = None
    host: object = None  # the same members over gloo; None: `group` is gloo already

    def all_reduce(self, tensor: torch.Tensor) -> torch.Tensor:
        if self.size > 1:
            dist.all_reduce(tensor, group=self.group)
        return tensor

    def broadcast(self, tensor: torch.Tensor, host: bool = False) -> torch.Tensor:
        """Member 0's `tensor` on every member, in place (over the host group when `host`: a CPU tensor)."""
        if self.size > 1:
            dist.broadcast(tensor, group=self.host_group if host else self.group, group_src=0)
        return tensor

    @property
    def host_group(self):
        return self.host if self.host is not None else self.group

    def all_gather_ints(self, values: list[int]) -> list[list[int]]:
        """Every member's short list of integers (one small host-side collective)."""
        if self.size == 1:
            return [list(values)]
        mine = torch.tensor(values, dtype=torch.int64)
        gathered = [torch.empty_like(mine) for _ in range(self.size)]
        dist.all_gather(gathered, mine, group=self.host_group)
        return [g.tolist() for g in gathered]

    def all_gather_rows(self, tensor: torch.Tensor, counts: list[int]) -> torch.Tensor:
        """Concatenate every member's rows (member i holds counts[i] rows) on every member."""
        if self.size == 1:
            return tensor
        width = max(counts)
        padded = tensor.new_zeros(width, *tensor.shape[1:])
        padded[: tensor.shape[0]] = tensor
        gathered = [torch.empty_like(padded) for _ in range(self.size)]
        dist.all_gather(gathered, padded, group=self.group)
        return torch.cat([g[:n] for g, n in zip(gathered, counts)])


@attrs.frozen
class ParallelState:
    """This rank's place: the world, its attention group, the expert-parallel group."""

    config: ParallelConfig
    rank: int = 0
    attn: Group = Group()  # ranks splitting attention and dense layers (and scheduling the same requests)
    world: Group = Group()

    @property
    def dp_rank(self) -> int:
        return self.rank // self.config.attn_tp_size

    @property
    def ep(self) -> Group:
        return self.world if self.config.ep_size > 1 else Group()

    @property
    def moe_tp(self) -> Group:
        """Ranks slicing every expert (ep_size == 1 with several ranks)."""
        return self.world if self.config.ep_size == 1 else Group()

    @property
    def is_output_rank(self) -> bool:
        """The first rank of each attention group reports that group's requests."""
        return self.attn.rank == 0


def default_backend(device: torch.device) -> str:
    return "nccl" if device.type == "cuda" else "gloo"


def init_parallel(config: ParallelConfig, rank: int, device: torch.device) -> ParallelState:
    """Join the process group and build the sub-groups (every rank creates every group, in order)."""
    if not config.distributed:
        return ParallelState(config)
    backend = config.dist_backend or default_backend(device)
    timeout = datetime.timedelta(seconds=config.timeout_s)
    if not dist.is_initialized():  # else the launcher has joined this rank to its rendezvous already
        address, port = config.dist_init_addr.rsplit(":", 1)
        dist.init_process_group(
            backend=backend, init_method=f"tcp://{address}:{port}", world_size=config.world_size, rank=rank, timeout=timeout
        )

    def host_of(members: list[int] | None):
        """A gloo group of the same members for host-side collectives (every rank makes every group, in order)."""
        return dist.new_group(members, backend="gloo", timeout=timeout) if backend != "gloo" else None

    world = Group(rank, config.world_size, dist.group.WORLD, host_of(None))
    attn_size = config.attn_tp_size
    attn = Group()
    for dp in range(config.dp_size):
        members = list(range(dp * attn_size, (dp + 1) * attn_size))
        if attn_size == config.world_size:
            attn = world
        elif attn_size > 1:
            group, host = dist.new_group(members), host_of(members)
            if rank in members:
                attn = Group(members.index(rank), attn_size, group, host)
    return ParallelState(config, rank, attn, world)


def local_rank(rank: int, config: ParallelConfig) -> int:
    return rank - config.node_rank * config.ranks_per_node


def rank_device(device: str, rank: int, config: ParallelConfig) -> str:
    """The device of one rank: `cuda` without an index means one GPU per rank of this machine."""
    if device != "cuda" or not config.distributed:
        return device
    index = local_rank(rank, config) % max(torch.cuda.device_count(), 1)
    torch.cuda.set_device(index)
    return f"cuda:{index}"


