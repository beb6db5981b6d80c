"""`ckplan calibrate` without torch: the attribution rule, the exact fit, the CLI's errors."""

import importlib.util
from fractions import Fraction

import pytest

from ckplan.calibrate.attribute import AttributionError, Call, attribute, resolve
from ckplan.calibrate.fit import Shape, check_shape, fit_op, fit_shapes, solve_exact
from ckplan.cli import main

# ---- the attribution rule ------------------------------------------------------------------


def hf_llama_eager_calls():
    """The top-level calls of transformers' LlamaDecoderLayer (eager) in order."""
    norm = [Call(n, norm="input_layernorm") for n in ("to", "pow", "mean", "add", "rsqrt",
                                                       "__mul__", "to", "__mul__")]  # fmt: skip
    norm2 = [Call(c.name, norm="post_attention_layernorm") for c in norm]
    return [
        *norm,
        Call("linear", proj="self_attn.q_proj"),
        Call("view"),
        Call("transpose"),
        Call("linear", proj="self_attn.k_proj"),
        Call("view"),
        Call("transpose"),
        Call("linear", proj="self_attn.v_proj"),
        Call("view"),
        Call("transpose"),
        Call("__mul__"),  # RoPE
        Call("cat"),
        Call("__add__"),
        Call("reshape"),  # repeat_kv
        Call("matmul"),
        Call("__mul__"),  # scaling
        Call("__add__"),  # mask
        Call("softmax"),
        Call("to"),
        Call("dropout"),
        Call("matmul"),
        Call("transpose"),
        Call("contiguous"),
        Call("reshape"),
        Call("linear", proj="self_attn.o_proj"),
        Call("__add__"),  # residual
        *norm2,
        Call("linear", proj="mlp.gate_proj"),
        Call("silu"),  # act_fn runs before up_proj
        Call("linear", proj="mlp.up_proj"),
        Call("__mul__"),
        Call("linear", proj="mlp.down_proj"),
        Call("__add__"),
    ]


def test_attribute_hf_llama_layer():
    calls = hf_llama_eager_calls()
    ops = attribute(calls)
    by_name = list(zip([c.name for c in calls], ops, strict=True))
    assert ops[:8] == ["norm1"] * 8
    # the projections are qkv_proj; the head views between them save nothing, core by the rule
    assert [op for name, op in by_name[8:17] if name == "linear"] == ["qkv_proj"] * 3
    assert {op for name, op in by_name[8:17] if name != "linear"} == {"attn_scores"}
    assert ("matmul", "attn_scores") in by_name and ("softmax", "softmax") in by_name
    assert ("to", "softmax") in by_name and ("dropout", "attn_dropout") in by_name
    assert by_name[by_name.index(("matmul", "attn_scores")) - 1] == ("reshape", "attn_scores")
    assert ("silu", "act") in by_name and ("__mul__", "act") in by_name
    assert by_name[-2:] == [("linear", "fc2"), ("__add__", "fc2")]
    assert ops.count("fc1") == 2 and ops.count("out_proj") == 2


def test_attribute_gpt2_block_with_sdpa_and_dropouts():
    calls = [
        Call("layer_norm", norm="ln_1"),
        Call("addmm", proj="attn.c_attn"),
        Call("split"),
        Call("scaled_dot_product_attention"),
        Call("transpose"),
        Call("addmm", proj="attn.c_proj"),
        Call("dropout"),
        Call("__add__"),
        Call("layer_norm", norm="ln_2"),
        Call("addmm", proj="mlp.c_fc"),
        Call("pow"),
        Call("tanh"),
        Call("addmm", proj="mlp.c_proj"),
        Call("dropout"),
        Call("__add__"),
    ]
    assert attribute(calls) == [
        "norm1", "qkv_proj", "attention_core", "attention_core", "attention_core", "out_proj",
        "out_dropout", "out_proj", "norm2", "fc1", "act", "act", "fc2", "mlp_dropout", "fc2",
    ]  # fmt: skip


def _norm(name):
    return [Call(n, norm=name) for n in ("to", "pow", "mean", "add", "rsqrt", "__mul__", "to")]


def sdpa_layer_calls(norms=("input_layernorm", "post_attention_layernorm"), qk=False, post=False):
    """Transformers' decoder layer with SDPA: Llama's, with `qk` Qwen3's norms on each head of
    Q and K, with `post` OLMo 2's norms on the sublayers' outputs instead of their inputs, and
    with four norms Gemma's on both."""
    q_norm = _norm("self_attn.q_norm") if qk else []
    k_norm = _norm("self_attn.k_norm") if qk else []
    attention = [
        Call("linear", proj="self_attn.q_proj"), Call("view"), *q_norm, Call("transpose"),
        Call("linear", proj="self_attn.k_proj"), Call("view"), *k_norm, Call("transpose"),
        Call("linear", proj="self_attn.v_proj"), Call("view"), Call("transpose"),
        Call("__mul__"), Call("cat"), Call("__add__"),  # RoPE
        Call("scaled_dot_product_attention"), Call("transpose"), Call("reshape"),
        Call("linear", proj="self_attn.o_proj"),
    ]  # fmt: skip
    mlp = [
        Call("linear", proj="mlp.gate_proj"), Call("silu"), Call("linear", proj="mlp.up_proj"),
        Call("__mul__"), Call("linear", proj="mlp.down_proj"),
    ]  # fmt: skip
    residual = [Call("__add__")]
    if len(norms) == 4:
        first, after_attention, before_mlp, last = (_norm(n) for n in norms)
        return [*first, *attention, *after_attention, *residual, *before_mlp, *mlp, *last,
                *residual]  # fmt: skip
    if post:
        return [*attention, *_norm(norms[0]), *residual, *mlp, *_norm(norms[1]), *residual]
    return [*_norm(norms[0]), *attention, *residual, *_norm(norms[1]), *mlp, *residual]


def test_attribute_qk_norms_on_each_head():
    calls = sdpa_layer_calls(qk=True)
    ops = attribute(calls)
    named = [(c.norm, op) for c, op in zip(calls, ops, strict=True) if c.norm]
    assert {op for norm, op in named if norm.endswith(("q_norm", "k_norm"))} == {"qk_norm"}
    assert ops.count("qk_norm") == 14
    plain = attribute(sdpa_layer_calls())
    assert [op for op in ops if op != "qk_norm"] == plain


def test_attribute_post_norms_count_where_ckplan_counts_them():
    """OLMo 2's norm after the attention is ckplan's norm2 and the one after the MLP its
    norm1 (the next layer's), with the residual adds after them."""
    calls = sdpa_layer_calls(("post_attention_layernorm", "post_feedforward_layernorm"), post=True)
    ops = attribute(calls)
    assert ops[0] == "qkv_proj" and ops[-8:] == ["norm1"] * 8
    assert ops[ops.index("out_proj") + 1 : ops.index("out_proj") + 8] == ["norm2"] * 7
    assert ops.count("out_proj") == 1 and ops.count("fc2") == 1 and ops.count("act") == 2
    assert "attention_core" in ops and ops.count("fc1") == 3  # the residual add joins fc1


def test_attribute_four_norms_as_gemma():
    norms = (
        "input_layernorm", "post_attention_layernorm", "pre_feedforward_layernorm",
        "post_feedforward_layernorm",
    )  # fmt: skip
    ops = attribute(sdpa_layer_calls(norms))
    assert ops[:7] == ["norm1"] * 7 and ops[-8:] == ["post_mlp_norm"] * 8
    assert ops.count("post_attn_norm") == 8 and ops.count("norm2") == 7
    assert ops.count("out_proj") == 1 and ops.count("fc2") == 1


@pytest.mark.parametrize(
    ("calls", "message"),
    [
        ([Call("layer_norm", norm="ln")], "1 norm(s)"),
        (
            [Call("x", norm="a"), Call("linear", proj="p"), Call("x", norm="b"),
             Call("x", norm="c")],
            "3 norm(s)",
        ),
        (
            [Call("x", norm="a"), Call("linear", proj="q"), Call("matmul"),
             Call("linear", proj="o"), Call("x", norm="b"), Call("linear", proj="f1"),
             Call("linear", proj="f2")],
            "1 matmul(s)",
        ),
        (
            [Call("x", norm="a"), Call("linear", proj="q"), Call("x", norm="b"),
             Call("linear", proj="f1"), Call("linear", proj="f2")],
            "the attention block has 1 projection",
        ),
    ],
)  # fmt: skip
def test_attribute_rejects_other_layouts(calls, message):
    with pytest.raises(AttributionError, match=message.replace("(", r"\(").replace(")", r"\)")):
        attribute(calls)


def test_resolve_keeps_shared_storages_outside_the_core():
    assert resolve(["attention_core", "out_proj"]) == "out_proj"  # flash O: out_proj's input
    assert resolve(["softmax", "attn_values"]) == "softmax"  # both in the core: the first
    assert resolve(["norm1"]) == "norm1"


# ---- the exact fit -------------------------------------------------------------------------


def test_fit_shapes_make_every_term_independent():
    for gqa in (True, False):
        rows = [shape.columns() for shape in fit_shapes(gqa)]
        target = [Fraction(3) * r["sbh"] + 5 * r["as2b"] + 7 * r["sb"] for r in rows]
        assert solve_exact(rows, target) == {"sbh": 3, "as2b": 5, "sb": 7}
        assert check_shape(gqa) not in fit_shapes(gqa)


def test_fit_folds_kv_width_into_sbh_without_gqa():
    rows = [shape.columns() for shape in fit_shapes(False)]
    assert all(r["sbgd"] == r["sbh"] for r in rows)
    assert solve_exact(rows, [r["sbgd"] for r in rows]) == {"sbh": 1}


def test_fit_op_per_dtype_class():
    """An HF RMSNorm in bf16: an fp32 copy (4 bytes) and a bf16 cast of sbh, an fp32 rstd."""
    samples = [(s, {"B": s.columns()["sbh"], 4: s.columns()["sbh"] + s.columns()["sb"]})
               for s in fit_shapes(True)]  # fmt: skip
    fit = fit_op("norm1", samples, dtype_bytes=2)
    assert fit.mapping() == {"sb": 4, "sbh": "B+4"} and fit.max_residual == 0
    heads = fit_op("attn_scores", [(s, {"B": 2 * s.columns()["sbh"]}) for s in fit_shapes(True)], 2)
    assert heads.mapping() == {"sbad": "2B"}  # inside the attention: the heads-sharded term


def test_fit_reports_what_is_no_function_of_the_terms():
    samples = [(s, {"B": s.seq**3}) for s in fit_shapes(True)]
    assert fit_op("act", samples, 2).max_residual > 0


def test_shape_text():
    assert Shape(16, 2, 64, 4, 2, 96).text() == "s=16 b=2 h=64 a=4 g=2 F=96"


# ---- the command line without torch --------------------------------------------------------


def test_calibrate_without_torch_names_the_extra(monkeypatch, capsys, tmp_path):
    real = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util, "find_spec", lambda name, *a: None if name == "torch" else real(name, *a)
    )
    out = tmp_path / "p.yaml"
    code = main(["calibrate", "gpt2", "--out", str(out)])
    stdout, err = capsys.readouterr()
    assert code == 2 and stdout == "" and not out.exists()
    assert len(err.strip().splitlines()) == 1 and "pip install 'ckplan[torch]'" in err


@pytest.mark.parametrize(
    ("argv", "fragment"),
    [
        (["calibrate", "gpt2", "--out", "p.txt"], "expected a .yaml file"),
        (["calibrate", "gpt2", "--out", "/no/such/folder/p.yaml"], "no such folder"),
        (["calibrate", "gpt2", "--device", "tpu"], "expected cpu or cuda"),
        (["calibrate", "nosuch"], "unknown model"),
    ],
)
def test_calibrate_bad_input_exit_2(capsys, argv, fragment):
    code = main(argv)
    out, err = capsys.readouterr()
    assert code == 2 and out == ""
    assert len(err.strip().splitlines()) == 1 and fragment in err, err


# ---- torch's tests fail, not skip, when CI requires torch ----------------------------------


def test_missing_torch_fails_when_required(monkeypatch):
    import needs_torch

    def no_torch(name):
        raise ImportError(name)

    monkeypatch.setattr(needs_torch.importlib, "import_module", no_torch)
    monkeypatch.delenv("CKPLAN_REQUIRE_TORCH", raising=False)
    with pytest.raises(pytest.skip.Exception, match="torch is not installed"):
        needs_torch.torch_or_skip()
    monkeypatch.setenv("CKPLAN_REQUIRE_TORCH", "1")
    with pytest.raises(pytest.fail.Exception, match="CKPLAN_REQUIRE_TORCH=1"):
        needs_torch.torch_or_skip()
