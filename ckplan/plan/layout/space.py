"""The layouts of N GPUs: every (tp, sp, pp and its split, v, cp, dp, ep, zero, micro-batch)
that Megatron-LM can run a model on, with tp·pp·cp·dp = N and micro_batch·microbatches·dp = the
global batch.

The rules, each Megatron-LM's (or the spec's, which follows it):
- tp inside one node (the GPU file's gpus_per_node), dividing the heads, the FFN width and, for
  experts, their width over etp; kv heads split over tp or replicated when tp exceeds them
  (`ops.kv_heads_per_rank`); sequence parallelism on or off with tp > 1 (on with experts);
- pp dividing the layers, or an uneven split (`pipeline_splits`);
- virtual stages v dividing each stage's layers, with microbatches a multiple of pp (Megatron's
  interleaved schedule: "number of microbatches is not divisible by pipeline-parallel size when
  using interleaved schedule");
- cp dividing the sequence; dp = N / (tp·pp·cp) dividing the global batch; every micro-batch
  size dividing global batch / dp;
- ZeRO 0-3 when something is data-parallel; ep dividing the experts with ep·etp dividing
  tp·cp·dp, etp tp (Megatron's default) or 1.
"""

from __future__ import annotations

import functools
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from typing import Any

from ckplan.model import frameworks
from ckplan.model.context_parallel import FRAMEWORK_CP_ATTENTIONS, node_a2a_size, te_cp_error
from ckplan.model.frameworks import layout_error
from ckplan.model.spec import ModelSpec

# The keys a layout sets; --set may fix any of them for the search (`constraints`).
LAYOUT_KEYS = (
    "tp",
    "sp",
    "pp",
    "cp",
    "dp",
    "zero",
    "virtual_stages",
    "micro_batch",
    "microbatches",
    "ep",
    "etp",
)
SPLIT_KEYS = (
    "first_stage_layers",
    "last_stage_layers",
    "account_for_embedding_in_pipeline_split",
    "account_for_loss_in_pipeline_split",
)


@functools.total_ordering
@dataclass(frozen=True)
class Split:
    """How the layers fall on the pipeline stages: evenly (all fields unset), Megatron's
    embedding/loss counted as layers, or explicit first/last stage layers."""

    first: int | None = None
    last: int | None = None
    embedding: bool = False
    loss: bool = False

    def __lt__(self, other: Split) -> bool:
        # Layouts sort by their fields; an unset first/last (None) sorts before any count
        # (order=True compared None with an int and raised on layouts tied in time).
        return self._order() < other._order()

    def _order(self) -> tuple:
        unset = -1
        first = unset if self.first is None else self.first
        last = unset if self.last is None else self.last
        return (first, last, self.embedding, self.loss)

    def keys(self) -> dict[str, Any]:
        keys: dict[str, Any] = {}
        if self.first is not None:
            keys["first_stage_layers"] = self.first
        if self.last is not None:
            keys["last_stage_layers"] = self.last
        if self.embedding:
            keys["account_for_embedding_in_pipeline_split"] = True
        if self.loss:
            keys["account_for_loss_in_pipeline_split"] = True
        return keys

    @property
    def even(self) -> bool:
        return self == Split()


@dataclass(frozen=True, order=True)
class Layout:
    tp: int
    sp: bool
    pp: int
    split: Split
    virtual_stages: int
    cp: int
    dp: int
    ep: int
    etp: int
    zero: int
    micro_batch: int
    microbatches: int
    # how the attention runs under cp > 1 (`cp_attention`): the spec's, or under Megatron-Core
    # each exchange Transformer Engine can run there (`cp_attentions`), with a2a+p2p's groups'
    # size (`cp_a2a_size`)
    cp_attention: str | None = None
    cp_a2a_size: int | None = None

    @property
    def gpus(self) -> int:
        return self.tp * self.pp * self.cp * self.dp

    def keys(self, experts: bool) -> dict[str, Any]:
        """The model keys that set this layout (`ckplan estimate --set KEY=VALUE`)."""
        keys: dict[str, Any] = {
            "tp": self.tp,
            "sp": self.sp,
            "pp": self.pp,
            "virtual_stages": self.virtual_stages,
            "cp": self.cp,
            "dp": self.dp,
            "zero": self.zero,
            "micro_batch": self.micro_batch,
            "microbatches": self.microbatches,
        }
        if experts:
            keys |= {"ep": self.ep, "etp": self.etp}
        if self.cp > 1 and self.cp_attention is not None:
            keys["cp_attention"] = self.cp_attention
        if self.cp > 1 and self.cp_a2a_size is not None:
            keys["cp_a2a_size"] = self.cp_a2a_size
        return keys | self.split.keys()

    def arrangement(self) -> tuple:
        """Everything but the ZeRO stage and the context-parallel exchange: how the model and
        the batch are split. Layouts equal in it are one entry of the search, the fastest that
        fits kept."""
        return (
            self.tp,
            self.sp,
            self.pp,
            self.split,
            self.virtual_stages,
            self.cp,
            self.dp,
            self.ep,
            self.etp,
            self.micro_batch,
            self.microbatches,
        )


def divisors(n: int) -> list[int]:
    """The divisors of n, increasing."""
    small, large = [], []
    k = 1
    while k * k <= n:
        if n % k == 0:
            small.append(k)
            if k * k != n:
                large.append(n // k)
        k += 1
    return small + large[::-1]


def pipeline_splits(layers: int, pp: int) -> list[Split]:
    """The ways to put `layers` on `pp` stages, every stage holding at least one layer.

    pp divides the layers: the even split only. Otherwise Megatron's ways to even out the
    rest: the embedding and the loss counted as layers (`account_for_..._in_pipeline_split`,
    when pp divides L + 2, or L + 1 with one of them), and explicit first/last stage layers
    (--decoder-first/last-pipeline-num-layers) around middle stages of m layers, m the fewest
    that leave the two ends 1..m layers each: the ends as equal as they can be and each end at
    m (the other lighter), the splits that differ in which end is lighter.
    """
    if pp == 1 or layers % pp == 0:
        return [Split()] if layers >= pp else []
    splits: list[Split] = []
    seen: set[tuple[int, ...]] = set()

    def add(split: Split, counts: tuple[int, ...]) -> None:
        if min(counts) >= 1 and counts not in seen:
            seen.add(counts)
            splits.append(split)

    for embedding, loss in ((True, True), (True, False), (False, True)):
        items = layers + embedding + loss
        if items % pp == 0:
            each = items // pp
            add(Split(embedding=embedding, loss=loss), (each - embedding, each - loss))
    if pp == 2:
        ends = [(layers // 2, layers - layers // 2), (layers - layers // 2, layers // 2)]
    else:
        middle = -(-layers // pp)
        while layers - (pp - 2) * middle > 2 * middle:
            middle += 1
        rest = layers - (pp - 2) * middle
        if rest < 2:
            return splits
        half = rest // 2
        ends = [(half, rest - half), (rest - half, half), (middle, rest - middle)]
        ends += [(rest - middle, middle)]
    for first, last in ends:
        add(Split(first=first, last=last), (first, last))
    return splits


def stage_items(layers: int, pp: int, split: Split) -> int | None:
    """Layers (with the embedding/loss items) per stage that virtual stages must divide; None
    for explicit first/last splits, which run without interleaving."""
    if split.first is not None or split.last is not None:
        return None
    return (layers + split.embedding + split.loss) // pp


@dataclass(frozen=True)
class SearchSpace:
    """What the search runs over: the model, N GPUs of `gpus_per_node`, the global batch, and
    the values --set fixed."""

    spec: ModelSpec
    gpus: int
    gpus_per_node: int
    global_batch: int
    constraints: Mapping[str, Any]

    def allowed(self, key: str, value: Any) -> bool:
        return key not in self.constraints or self.constraints[key] == value


def tensor_parallel_sizes(space: SearchSpace) -> list[int]:
    """tp inside one node, dividing N, the heads and the FFN widths; kv heads and tp must
    divide one another (split or replicated); 1 with LoRA adapters or quantised weights."""
    spec = space.spec
    sizes = []
    for tp in divisors(space.gpus):
        if tp > space.gpus_per_node or not space.allowed("tp", tp):
            continue
        if spec.heads % tp or spec.ffn_hidden % tp:
            continue
        if spec.kv_heads % tp and tp % spec.kv_heads:
            continue
        if spec.shared_experts and spec.shared_ffn_hidden % tp:
            continue
        if tp > 1 and (spec.finetune.adapters or spec.weight_format in ("nf4", "fp4", "int8")):
            continue  # LoRA and quantised weights are modelled on tp 1 (docs/fine-tuning.md)
        if tp > 1 and spec.optimizer in ("adamw-8bit", "paged-adamw-8bit", "adafactor"):
            continue  # per-tensor optimizer states are modelled on tp 1 (docs/fine-tuning.md)
        sizes.append(tp)
    return sizes


MEGATRON_CP_ATTENTIONS = FRAMEWORK_CP_ATTENTIONS["megatron"]


def cp_attentions(
    spec, tp: int, cp: int, gpus_per_node: int
) -> tuple[tuple[str | None, int | None], ...]:
    """The ways the search runs the attention at (tp, cp), each (`cp_attention`,
    `cp_a2a_size`): the spec's, or under Megatron-Core with cp > 1 and none given each of
    Transformer Engine's that runs there (ring, allgather, a2a, and a2a+p2p with its groups
    inside a node, `node_a2a_size`: `context_parallel.te_cp_error`); none where the given one
    cannot run (a2a+p2p where `cp_a2a_size` does not split cp in two levels)."""
    if cp == 1 or spec.framework != "megatron":
        return ((spec.cp_attention, spec.cp_a2a_size),)
    if spec.cp_attention:
        given = spec.cp_attention, spec.cp_a2a_size
        return (given,) if te_cp_error(spec, given[0], tp, cp, given[1]) is None else ()
    tried = []
    for name in MEGATRON_CP_ATTENTIONS:
        if name != "a2a+p2p":
            if te_cp_error(spec, name, tp, cp) is None:
                tried.append((name, None))
        elif size := node_a2a_size(spec, tp, cp, gpus_per_node):  # checked there
            tried.append((name, size))
    return tuple(tried)


def layouts(space: SearchSpace) -> Iterator[Layout]:
    """Every layout of the search space (module docstring)."""
    spec = space.spec
    n, batch = space.gpus, space.global_batch
    experts = spec.experts > 0
    for tp in tensor_parallel_sizes(space):
        sps = (True,) if experts and tp > 1 else (False, True) if tp > 1 else (False,)
        sps = tuple(sp for sp in sps if space.allowed("sp", sp))
        for pp in divisors(n // tp):
            if pp > spec.layers or not space.allowed("pp", pp):
                continue
            splits = pipeline_splits(spec.layers, pp)
            for cp in divisors(n // (tp * pp)):
                if spec.seq % cp or not space.allowed("cp", cp):
                    continue
                dp = n // (tp * pp * cp)
                if batch % dp or not space.allowed("dp", dp):
                    continue
                exchanges = cp_attentions(spec, tp, cp, space.gpus_per_node)
                for ep, etp in _expert_layouts(space, tp, cp, dp):
                    zeros = tuple(
                        zero
                        for zero in (
                            (0, 1, 2, 3)
                            if dp > 1 or (experts and tp * cp * dp > ep * etp)
                            else (0, 1)
                            if spec.fp8_param_gather
                            else (0,)
                        )
                        if layout_error(spec.framework, zero, tp, pp, cp, ep) is None
                    )
                    for micro_batch in divisors(batch // dp):
                        microbatches = batch // (dp * micro_batch)
                        if not space.allowed("micro_batch", micro_batch):
                            continue
                        if not space.allowed("microbatches", microbatches):
                            continue
                        for split in splits:
                            for v in _virtual_stages(space, pp, split, microbatches):
                                for sp in sps:
                                    for zero in zeros:
                                        if not space.allowed("zero", zero):
                                            continue
                                        if not _optimizer_allows(spec, zero, pp, microbatches):
                                            continue
                                        for exchange, a2a_size in exchanges:
                                            yield Layout(
                                                tp,
                                                sp,
                                                pp,
                                                split,
                                                v,
                                                cp,
                                                dp,
                                                ep,
                                                etp,
                                                zero,
                                                micro_batch,
                                                microbatches,
                                                exchange,
                                                a2a_size,
                                            )


def _optimizer_allows(spec: ModelSpec, zero: int, pp: int, microbatches: int) -> bool:
    """The optimizer's rules on a layout (`spec._validate_optimizer`): Adafactor on zero 0,
    FP8 primary weights on zero 1 (`spec._validate_fp8_param_gather`),
    the step in backward on one pipeline stage and one micro-batch, model states on the host
    where the framework runs them (`frameworks.state_offload_error`)."""
    if spec.optimizer == "adafactor" and zero >= 1:
        return False
    if spec.fp8_param_gather and zero != 1:  # the distributed optimizer's (spec)
        return False
    if frameworks.state_offload_error(spec, zero, pp, microbatches):
        return False
    return not (spec.optimizer_in_backward and (pp > 1 or microbatches > 1))


def _virtual_stages(space: SearchSpace, pp: int, split: Split, microbatches: int) -> list[int]:
    items = stage_items(space.spec.layers, pp, split)
    choices = [1]
    if pp > 1 and items is not None and microbatches % pp == 0:
        choices = divisors(items)
    return [v for v in choices if space.allowed("virtual_stages", v)]


def _expert_layouts(space: SearchSpace, tp: int, cp: int, dp: int) -> list[tuple[int, int]]:
    """(ep, etp) pairs: ep dividing the experts, etp tp (Megatron's default) or 1, dividing
    the experts' width, ep·etp dividing tp·cp·dp. (1, tp) without experts, and beside frozen
    base weights, whose experts split as the layer's other weights (docs/fine-tuning.md)."""
    spec = space.spec
    if not spec.experts:
        return [(1, tp)]
    if spec.training != "full":
        fits = spec.moe_ffn_hidden % tp == 0 and space.allowed("ep", 1)
        return [(1, tp)] if fits and space.allowed("etp", tp) else []
    pairs = []
    for etp in dict.fromkeys((tp, 1)):
        if spec.moe_ffn_hidden % etp or not space.allowed("etp", etp):
            continue
        for ep in divisors(spec.experts):
            if (tp * cp * dp) % (ep * etp) == 0 and space.allowed("ep", ep):
                pairs.append((ep, etp))
    return pairs


def constraints_from(settings: Mapping[str, Any]) -> dict[str, Any]:
    """The layout keys among --set overrides: the search keeps them fixed."""
    return {key: settings[key] for key in LAYOUT_KEYS if key in settings}
