"""DualPipe (pipeline_schedule: dualpipe) against a replay of its reference implementation's
order: deepseek-ai/DualPipe at 3da1bbe, dualpipe/dualpipe.py `DualPipe.step`, and the
DeepSeek-V3 Technical Report (arXiv 2412.19437) §3.2.1 and Table 2."""

from collections import defaultdict

import pytest

from ckplan.hardware.code_path import spec_code_path
from ckplan.hardware.dualpipe import Chunk, exposed_beside, forward_backward_seconds, paired_chunks
from ckplan.hardware.step_time import (
    carries_weight_gradient,
    dualpipe_bubble_seconds,
    stage_weight_gradient_seconds,
    step_time,
)
from ckplan.inputs.gpus import load_gpu
from ckplan.model import memory
from ckplan.model.layers import stage_kinds
from ckplan.model.ops import layer_ops
from ckplan.model.spec import SpecError
from ckplan.plan import evaluate, parse_strategy
from ckplan.plan.evaluate import dualpipe_in_flight, dualpipe_rank_peaks
from ckplan.plan.layer_chain import layer_chain
from ckplan.schedules import held_after_forward_bytes, simulate, store_all_schedule

# ---- the reference order ---------------------------------------------------------------------


def reference_program(pp: int, m: int, rank: int) -> list[tuple]:
    """One rank's operations in `DualPipe.step`'s order, as written there (steps 1-8, the
    middle ranks' first step 4 unoverlapped, the zero-bubble flags of steps 3, 6 and 7),
    each a ("recv" | "send", (kind, direction)), ("commit",), ("F", direction),
    ("B", direction, zero_bubble), ("FB", direction, direction) or ("W",). Direction 0 runs
    from rank 0 to rank p - 1 through model stage `rank` (module 0), direction 1 back
    through stage p - 1 - rank (module 1); `phase ^= is_in_second_half` as in the code."""
    half, h = pp // 2, min(rank, pp - 1 - rank)
    second, middle = rank >= half, rank in (half - 1, half)
    first_rank, last_rank = rank == 0, rank == pp - 1
    out: list[tuple] = []

    def first_stage(d):
        return (first_rank and d == 0) or (last_rank and d == 1)

    def last_stage(d):
        return (first_rank and d == 1) or (last_rank and d == 0)

    def recv_f(phase):
        if not first_stage(phase ^ second):
            out.append(("recv", ("F", phase ^ second)))

    def send_f(phase):
        if not last_stage(phase ^ second):
            out.append(("send", ("F", phase ^ second)))

    def recv_b(phase):
        if not last_stage(phase ^ second):
            out.append(("recv", ("B", phase ^ second)))

    def send_b(phase):
        if not first_stage(phase ^ second):
            out.append(("send", ("B", phase ^ second)))

    def forward(phase, recv=True, send=True):
        if recv:
            recv_f(phase)
        out.extend([("commit",), ("F", phase ^ second)])
        if send:
            send_f(phase)

    def backward(phase, zb=False, recv=True, send=True):
        if recv:
            recv_b(phase)
        out.extend([("commit",), ("B", phase ^ second, zb)])
        if send:
            send_b(phase)

    def overlapped(phase0, phase1, recv0=True):
        if recv0:
            recv_f(phase0)
        recv_b(phase1)
        out.extend([("commit",), ("FB", phase0 ^ second, phase1 ^ second)])
        send_f(phase0)
        send_b(phase1)

    def weight():
        out.extend([("commit",), ("W",)])

    for _ in range((half - h - 1) * 2):  # step 1: nF0
        forward(0)
    recv_f(0)  # step 2: nF0F1
    for i in range(h + 1):
        forward(0, recv=False, send=middle)
        recv_f(0)
        forward(1, send=(not middle) or (i < h))
        if not middle:
            send_f(0)
    for _ in range(half - h - 1):  # step 3: nB1W1F1
        backward(1, zb=True)
        recv_f(1)
        weight()
        forward(1, recv=False)
    for i in range(m // 2 - pp + h + 1):  # step 4: nF0B1F1B0
        if i == 0 and middle:
            forward(0, recv=False, send=False)
            send_f(1)
            backward(1, send=False)
            send_f(0)
            send_b(1)
        else:
            overlapped(0, 1, recv0=i > 0)
        overlapped(1, 0)
    for _ in range(half - h - 1):  # step 5: nB1F1B0
        backward(1)
        overlapped(1, 0)
    zb = False
    for i in range(h + 1):  # step 6: nB1B0, the second half with zero bubble
        if i == (h + 1) // 2 and h % 2 == 1:
            zb = True
        backward(1, zb)
        if i == (h + 1) // 2 and h % 2 == 0:
            zb = True
        backward(0, zb)
    for _ in range(half - h - 1):  # step 7: nWB0
        weight()
        backward(0, zb=True)
    for _ in range(h + 1):  # step 8: nW
        weight()
    out.append(("commit",))
    return out


def held_peak(pp: int, m: int, rank: int) -> tuple[int, int]:
    """(direction 0, direction 1) forwards awaiting their backward at the rank's fullest."""
    held, best, at = [0, 0], -1, None
    done = defaultdict(int)
    for op in reference_program(pp, m, rank):
        if op[0] == "F":
            held[op[1]] += 1
        elif op[0] == "FB":
            held[op[1]] += 1
            if sum(held) > best:
                best, at = sum(held), tuple(held)
            held[op[2]] -= 1
            done[op[2]] += 1
        elif op[0] == "B":
            held[op[1]] -= 1
            done[op[1]] += 1
        if sum(held) > best:
            best, at = sum(held), tuple(held)
    assert held == [0, 0] and done == {0: m // 2, 1: m // 2}
    return at


def replay_span(pp: int, m: int, f: float, b: float, w: float, fb: float) -> tuple[float, float]:
    """(iteration time, the busiest rank's compute) of the reference order with dependencies:
    a forward F, a backward B (B - W where the weight pass is deferred, a W later), an
    overlapped pair F&B; a rank's sends are posted at its next commit, its receives wait for
    the sender's matching send (derived from `_commit_and_wait_comm`)."""
    programs = [reference_program(pp, m, rank) for rank in range(pp)]
    pc, now, busy = [0] * pp, [0.0] * pp, [0.0] * pp
    posted: dict = defaultdict(list)
    taken: dict = defaultdict(int)
    recvs: list[list] = [[] for _ in range(pp)]
    sends: list[list] = [[] for _ in range(pp)]

    def source(rank, channel):
        kind, direction = channel
        return rank - 1 if (kind == "F") == (direction == 0) else rank + 1

    moved = True
    while moved:
        moved = False
        for rank in range(pp):
            while pc[rank] < len(programs[rank]):
                op = programs[rank][pc[rank]]
                if op[0] == "recv":
                    recvs[rank].append(op[1])
                elif op[0] == "send":
                    sends[rank].append(op[1])
                elif op[0] == "commit":
                    for channel in sends[rank]:
                        posted[(rank, channel)].append(now[rank])
                    sends[rank] = []
                    wanted = defaultdict(int)
                    arrivals = []
                    for channel in recvs[rank]:
                        index = taken[(rank, channel)] + wanted[channel]
                        wanted[channel] += 1
                        queue = posted[(source(rank, channel), channel)]
                        if index >= len(queue):
                            break
                        arrivals.append(queue[index])
                    else:
                        for channel, count in wanted.items():
                            taken[(rank, channel)] += count
                        recvs[rank] = []
                        now[rank] = max([now[rank], *arrivals])
                        pc[rank] += 1
                        moved = True
                        continue
                    break
                else:
                    seconds = {"F": f, "W": w, "FB": fb}.get(op[0])
                    if op[0] == "B":
                        seconds = b - w if op[2] else b
                    now[rank] += seconds
                    busy[rank] += seconds
                pc[rank] += 1
                moved = True
    assert all(pc[rank] == len(programs[rank]) for rank in range(pp)), "the replay deadlocked"
    return max(now), max(busy)


EVEN_PP = (2, 4, 6, 8, 16)


def micro_batch_counts(pp):
    return (2 * pp, 2 * pp + 2, 4 * pp)


# ---- in flight -------------------------------------------------------------------------------


def test_in_flight_by_hand():
    """Table 2: PP + 1 micro-batches; rank k holds p - k of its own stage, k + 1 of its mirror."""
    assert dualpipe_in_flight(4, 0) == (4, 1)
    assert dualpipe_in_flight(4, 1) == (3, 2)
    assert dualpipe_in_flight(4, 2) == (2, 3)  # stage 2: 2, stage 1: 3, as rank 1 mirrored
    assert dualpipe_in_flight(16, 15) == (1, 16)
    assert all(sum(dualpipe_in_flight(16, rank)) == 17 for rank in range(16))


@pytest.mark.parametrize("pp", EVEN_PP)
def test_in_flight_matches_the_reference_order(pp):
    for m in micro_batch_counts(pp):
        for rank in range(pp):
            assert held_peak(pp, m, rank) == dualpipe_in_flight(pp, rank), (pp, m, rank)


def test_rank_peaks_combine_the_two_stages_by_hand():
    # p 4: rank 0 holds 4 of stage 0 and 1 of stage 3; rank 1 3 of stage 1 and 2 of stage 2
    peaks = {0: 1000, 1: 700, 2: 600, 3: 900}
    held = {0: 200, 1: 150, 2: 150, 3: 100}
    ranks = dualpipe_rank_peaks(4, peaks, held)
    assert ranks[0] == (max(1000 + 1 * 100, 900 + 4 * 200), 3)
    assert ranks[1] == (max(700 + 2 * 150, 600 + 3 * 150), 2)
    assert set(ranks) == {0, 1}


# ---- the bubble ------------------------------------------------------------------------------


def test_bubble_by_hand():
    """Table 2 against 1F1B's (PP - 1)(F + B), F 1, B 2, W 1, F&B 3 (no overlap credit)."""
    assert dualpipe_bubble_seconds(2, 3.0, 2.0, 1.0) == 0.0
    assert dualpipe_bubble_seconds(4, 3.0, 2.0, 1.0) == 2.0  # 1F1B: 3 · 3 = 9
    assert dualpipe_bubble_seconds(8, 3.0, 2.0, 1.0) == 6.0  # 1F1B: 21
    assert dualpipe_bubble_seconds(16, 3.0, 2.0, 0.5) == 7 * 3.5


@pytest.mark.parametrize("pp", EVEN_PP)
@pytest.mark.parametrize("f, w", [(1.0, 1.0), (1.0, 0.5), (2.0, 1.0), (1.0, 0.8)])
def test_replay_bubble_is_table_2_when_the_input_gradient_takes_a_forward(pp, f, w):
    """The replay's idle time on its busiest rank is Table 2's exactly when B - W = F and
    F&B = F + B (what ckplan charges), for every micro-batch count."""
    b = f + w
    for m in micro_batch_counts(pp):
        span, busy = replay_span(pp, m, f, b, w, f + b)
        assert busy == pytest.approx(m * (f + b))
        assert span - busy == pytest.approx(dualpipe_bubble_seconds(pp, f + b, b, w))


@pytest.mark.parametrize("pp", (4, 8, 16))
@pytest.mark.parametrize("f, b, w", [(1.0, 2.1, 0.85), (1.0, 2.0, 0.8), (1.0, 2.3, 1.0)])
def test_table_2_is_an_upper_bound_on_transformer_like_chunks(pp, f, b, w):
    """Where the input gradient outlasts a forward (attention's backward has no weight
    gradient: B - W > F), Table 2 charges more idle time than the replay: conservative."""
    span, busy = replay_span(pp, 4 * pp, f, b, w, f + b)
    assert span - busy <= dualpipe_bubble_seconds(pp, f + b, b, w) + 1e-9
    assert span - busy < (pp - 1) * (f + b)  # and far less than 1F1B's


# ---- the model -------------------------------------------------------------------------------


def test_spec_rules(spec_of):
    with pytest.raises(SpecError, match="even pp"):
        spec_of("gpt2", pp=3, microbatches=6, pipeline_schedule="dualpipe")
    with pytest.raises(SpecError, match=r"at least 2·pp \(8\)"):
        spec_of("gpt2", pp=4, microbatches=6, pipeline_schedule="dualpipe")
    with pytest.raises(SpecError, match="virtual_stages: 1"):
        spec_of("gpt2", pp=2, virtual_stages=2, microbatches=4, pipeline_schedule="dualpipe")
    spec = spec_of("gpt2", pp=4, microbatches=8, pipeline_schedule="dualpipe")
    assert spec.pipeline_schedule == "dualpipe"
    assert spec_of("gpt2").pipeline_schedule == "1f1b"


def test_each_rank_holds_its_stage_and_its_mirror(spec_of):
    spec = spec_of("gpt2", pp=4, microbatches=8, pipeline_schedule="dualpipe")
    plain = spec.replace(pipeline_schedule="1f1b")
    for rank in range(4):
        assert memory.rank_stages(spec, rank) == (rank, 3 - rank)
        own, mirror = memory.stage_parameters(plain, rank), memory.stage_parameters(plain, 3 - rank)
        assert memory.stage_parameters(spec, rank) == (own[0] + mirror[0], own[1] + mirror[1])
    # rank 0 holds the embedding and the output layer: twice the 1F1B first stage's and more
    assert memory.model_state_bytes(spec, 0).total == (
        memory.model_state_bytes(plain, 0).total + memory.model_state_bytes(plain, 3).total
    )


def test_plan_peak_is_the_rank_with_its_two_stages(spec_of):
    spec = spec_of("gpt2", pp=4, microbatches=8, layers=12, pipeline_schedule="dualpipe")
    strategy = parse_strategy("none", spec)
    peaks, held = {}, {}
    for stage in range(4):
        chain = layer_chain(spec, strategy.groups, stage=stage)
        replay = simulate(chain, store_all_schedule(chain))
        waiting = held_after_forward_bytes(chain, replay, output_held=stage != 3)
        peaks[stage] = replay.peak_bytes + (4 - stage - 1) * waiting
        held[stage] = held_after_forward_bytes(chain, replay)
    ranks = dualpipe_rank_peaks(4, peaks, held)
    plan = evaluate(spec, strategy)
    rank = max(ranks, key=lambda r: (ranks[r][0] + memory.model_state_bytes(spec, r).total, -r))
    assert plan.peak_stage == rank
    assert plan.activation_bytes == ranks[rank][0]
    plain = evaluate(spec.replace(pipeline_schedule="1f1b"), strategy)
    assert plan.activation_bytes > plain.activation_bytes  # p + 1 micro-batches, not p
    # every micro-batch passes every rank once: the FLOPs of one micro-batch per stage, m of
    # them spread over the two stages of a rank
    assert plan.flops.total < plain.flops.total  # the last stage's head is shared with stage 0


# ---- the time ----------------------------------------------------------------------------------


def test_weight_gradient_ops_are_the_weighted_gemms(spec_of):
    spec = spec_of("llama3-8b")
    weighted = {op.name for op in layer_ops(spec) if carries_weight_gradient(op)}
    assert weighted == {"qkv_proj", "out_proj", "fc1", "fc2"}  # not the attention core


def test_weight_gradient_is_half_a_linear_backward_as_pytorch_counts_it():
    """A linear's backward in PyTorch: the input gradient and the weight gradient GEMMs of equal
    FLOPs (torch.utils.flop_counter), what `_weight_gradient_seconds` halves."""
    torch = pytest.importorskip("torch")
    from torch.utils.flop_counter import FlopCounterMode

    layer = torch.nn.Linear(64, 256, bias=False)
    x = torch.randn(8, 64, requires_grad=True)
    y = layer(x)
    grad = torch.ones_like(y)
    with FlopCounterMode(display=False) as inputs:
        torch.autograd.grad(y, x, grad, retain_graph=True)
    with FlopCounterMode(display=False) as weights:
        torch.autograd.grad(y, layer.weight, grad)
    assert inputs.get_total_flops() == weights.get_total_flops() == 2 * 8 * 64 * 256


def test_step_time_bubble_is_table_2(spec_of):
    gpu = load_gpu("h100-sxm")
    spec = spec_of("gpt2", pp=4, microbatches=8, layers=12, pipeline_schedule="dualpipe")
    plan = evaluate(spec, parse_strategy("none", spec))
    time = step_time(plan, gpu)
    two = spec.replace(pp=2, microbatches=4)
    assert step_time(evaluate(two, parse_strategy("none", two)), gpu).bubble_seconds == 0.0
    plain = spec.replace(pipeline_schedule="1f1b")
    plain_time = step_time(evaluate(plain, parse_strategy("none", plain)), gpu)
    # one bubble step under p 4 against 1F1B's three; W is under half the backward
    assert 0 < time.bubble_seconds < plain_time.bubble_seconds
    w = [stage_weight_gradient_seconds(spec, gpu, stage) for stage in range(4)]
    # a middle stage: half the backward GEMMs of its layers' weighted ops (each a linear here,
    # its two products of equal FLOPs and shapes transposed)
    path = spec_code_path(spec, gpu)
    weighted = [op for op in layer_ops(spec) if carries_weight_gradient(op)]
    per_layer = sum(path.backward(op, spec.dtype_bytes).matmul for op in weighted) / 2
    assert w[1] == w[2] == pytest.approx(len(stage_kinds(spec, 1)) * per_layer)
    assert w[0] == pytest.approx(w[1])  # the embedding's gradient is no GEMM
    assert w[3] > w[1]  # the output layer's weight gradient


def test_mtp_word_embedding_is_shared_on_the_first_rank(spec_of):
    """DeepSeek-V3 §3.2.3: DualPipe puts the embedding and the MTP module on one rank, which
    shares their word embedding; the middle ranks hold two plain stages."""
    spec = spec_of(
        "gpt2", pp=4, microbatches=8, layers=12, mtp_layers=1, tied_embeddings=False,
        pipeline_schedule="dualpipe",
    )  # fmt: skip
    plain = spec.replace(pipeline_schedule="1f1b")
    words = spec.vocab * spec.hidden
    first = memory.stage_parameters(plain, 0)
    last = memory.stage_parameters(plain, 3)
    assert memory.stage_parameters(spec, 0) == (first[0] + last[0] - words, first[1] + last[1])
    middle = [memory.stage_parameters(plain, stage) for stage in (1, 2)]
    assert memory.stage_parameters(spec, 1)[0] == middle[0][0] + middle[1][0]


def test_timeline_waits_with_both_stages(spec_of):
    """The timeline of a DualPipe plan: the running stage's replay with its own other in-flight
    micro-batches and the other stage's waiting beside it, computed from the chains."""
    from ckplan.plan.timeline import memory_timeline

    spec = spec_of("gpt2", pp=4, microbatches=8, layers=12, pipeline_schedule="dualpipe")
    plan = evaluate(spec, parse_strategy("none", spec))
    rank = plan.peak_stage
    counts = dict(zip((rank, 3 - rank), dualpipe_in_flight(4, rank), strict=True))
    held = {}
    for stage in counts:
        chain = layer_chain(spec, (), stage=stage)
        replay = simulate(chain, store_all_schedule(chain))
        held[stage] = (replay, chain)
    side = next(s for s in counts if _names(spec, s) == tuple(plan.stage_names))
    other = 3 - side
    replay, chain = held[side]
    other_replay, other_chain = held[other]
    own_waiting = held_after_forward_bytes(chain, replay, output_held=side != 3)
    other_waiting = held_after_forward_bytes(other_chain, other_replay)
    expected = (counts[side] - 1) * own_waiting + counts[other] * other_waiting
    timeline = memory_timeline(plan)
    assert timeline.waiting_bytes == expected
    assert timeline.peak_bytes == plan.activation_bytes


def _names(spec, stage):
    from ckplan.plan.layer_chain import stage_names

    return tuple(stage_names(spec, stage=stage))


# ---- the overlapped pairs (DeepSeek-V3 §3.2.1-§3.2.2) ----------------------------------------


@pytest.mark.parametrize("pp", EVEN_PP)
def test_paired_chunks_count_the_reference_pairs(pp):
    """`paired_chunks` is the number of `_forward_backward_chunk` calls of each rank."""
    for m in micro_batch_counts(pp):
        for rank in range(pp):
            pairs = sum(1 for op in reference_program(pp, m, rank) if op[0] == "FB")
            assert paired_chunks(pp, m, rank) == pairs, (pp, m, rank)


def test_paired_chunks_by_hand():
    # p 16, m 120 (the DeepSeek-V3 run): rank 0 runs 2·(60 - 16 + 1) + 7 = 97 pairs, a middle
    # rank 2·(60 - 16 + 8) - 1 + 0 = 103; the rest of its 120 forwards and backwards alone
    assert paired_chunks(16, 120, 0) == paired_chunks(16, 120, 15) == 97
    assert paired_chunks(16, 120, 7) == paired_chunks(16, 120, 8) == 103
    assert paired_chunks(4, 8, 0) == 2 * (4 - 4 + 1) + 1 == 3


def test_exposed_beside_by_hand():
    """20 of 132 SMs held by the communication (§3.2.2): the compute beside it takes 132/112
    of its time while both run."""
    contended = 2.0 * 132 / 112
    # the compute outlasts the communication: it adds the compute's slowdown, 1 · 20/132
    assert exposed_beside(1.0, 2.0, 132, 20) == pytest.approx(1.0 * (1 - 2.0 / contended))
    assert exposed_beside(1.0, 2.0, 132, 20) == pytest.approx(20 / 132)
    # it outlasts the slowed compute: what it does not hide, 3 - 2
    assert exposed_beside(3.0, 2.0, 132, 20) == pytest.approx(1.0)
    assert exposed_beside(0.0, 2.0, 132, 20) == 0.0
    assert exposed_beside(1.0, 0.0, 132, 20) == 1.0  # nothing beside it: exposed
    assert exposed_beside(1.0, 2.0, 8, 20) == 0.0  # no SMs to spare: no slowdown counted


def test_forward_backward_pair_by_hand():
    forward = Chunk(compute=1.0, expert=0.5, pipeline=0.1, other=0.2)
    backward = Chunk(compute=2.0, expert=0.5, pipeline=0.1)
    # the forward's 0.6 beside the backward's 2 and the backward's 0.6 beside the forward's 1:
    # both under the slowed compute (2·132/112, 1·132/112), each adds 0.6 · 20/132
    assert forward_backward_seconds(forward, backward, 132) == pytest.approx(
        1.0 + 2.0 + 0.2 + 2 * 0.6 * 20 / 132
    )
    # all-to-alls longer than the other chunk's compute show their excess
    heavy = Chunk(compute=1.0, expert=4.0)
    assert forward_backward_seconds(heavy, Chunk(compute=2.0, expert=0.5), 132) == pytest.approx(
        1.0 + 2.0 + (4.0 - 2.0) + 0.5 * 20 / 132
    )


@pytest.mark.parametrize(
    "compute_f, compute_b, comm_f, comm_b",
    [(1.0, 2.0, 0.0, 0.0), (1.0, 2.0, 3.0, 3.0), (0.5, 1.1, 0.4, 2.0), (2.0, 4.0, 0.3, 0.1)],
)
def test_a_pair_is_bounded_by_its_compute_and_its_chunks_alone(
    compute_f, compute_b, comm_f, comm_b
):
    forward, backward = Chunk(compute_f, comm_f), Chunk(compute_b, comm_b)
    pair = forward_backward_seconds(forward, backward, 132)
    assert max(compute_f + compute_b, compute_f + comm_b, compute_b + comm_f) <= pair + 1e-12
    assert pair <= forward.alone + backward.alone + 1e-12


@pytest.mark.parametrize("pp", (4, 8, 16))
@pytest.mark.parametrize("fb", [2.2, 2.6, 3.1])
def test_paired_busy_time_and_table_2_against_the_replay(pp, fb):
    """With F&B under F + B, the busiest rank's busy time is its pairs at F&B and the rest alone
    (what `dualpipe_rank_time` charges), and Table 2's bubble bounds the replay's idle time on
    transformer-like chunks (B - W > F)."""
    f, b, w = 1.0, 2.1, 0.85
    m = 4 * pp
    span, busy = replay_span(pp, m, f, b, w, fb)
    charged = [
        paired_chunks(pp, m, rank) * fb + (m - paired_chunks(pp, m, rank)) * (f + b)
        for rank in range(pp)
    ]
    assert busy == pytest.approx(max(charged))
    assert span <= max(charged) + dualpipe_bubble_seconds(pp, fb, b, w) + 1e-9


def test_deepseek_v3_pairs_hide_expert_parallel_communication(monkeypatch):
    """The DeepSeek-V3 run: the GPU file leaves the all-to-alls exposed (ep_overlap 0), so the
    hiding comes from the pairs alone (none paired: all of it exposed, the step longer by what
    the pairs hide); the step's parts still sum to it."""
    from ckplan.hardware import step_time as step_time_module
    from ckplan.published.suite import run_suite

    prediction = run_suite("deepseek-v3-2048xh800")[0]
    plan, gpu = prediction.plan, load_gpu("h800")
    assert gpu.ep_overlap == 0.0
    time = step_time(plan, gpu)
    monkeypatch.setattr(step_time_module, "paired_chunks", lambda pp, m, rank: 0)
    alone = step_time(plan, gpu)
    assert time.expert_parallel_seconds < alone.expert_parallel_seconds
    hidden = alone.communication_seconds - time.communication_seconds
    assert hidden > 0
    # the pairs shorten the chunks by what they hide; the bubble by a shorter F&B
    assert alone.step_seconds - time.step_seconds == pytest.approx(
        hidden + alone.bubble_seconds - time.bubble_seconds
    )
    assert time.forward_seconds == alone.forward_seconds
    parts = (
        time.forward_seconds
        + time.backward_seconds
        + time.recompute_seconds
        + time.communication_seconds
        + time.bubble_seconds
        + time.optimizer_seconds
    )
    assert parts == pytest.approx(time.step_seconds)
    assert 0 < time.expert_parallel_seconds < time.communication_seconds
