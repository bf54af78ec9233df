"""The logit softcap in the Gluon forward (gluon_forward.SOFTCAP_IN_KERNEL): which calls reach the
kernel with it, what its launches carry, and what stays on the portable kernel. A CPU runs no
Gluon: the launches are recorded and the routes stood in for (benchmarks/softcap_check.py checks
the kernel's numbers on an H200). The variants compile for sm_90 in test_gluon_compile (they are in
GLUON_VARIANTS)."""

import pytest
import torch

from flashtile.kernels import forward, gluon_forward
from flashtile.kernels.gluon_forward import LOG2E
from helpers import record_gluon_launches

BF16 = torch.bfloat16
SCALE, CAP = 0.1, 30.0


@pytest.fixture
def launches(monkeypatch):
    """gluon_forward's launches recorded instead of run, on a stand-in sm_90 with 132 SMs."""
    recorded = record_gluon_launches(monkeypatch)
    monkeypatch.setattr(gluon_forward, "_GLUON", True)
    monkeypatch.setattr(gluon_forward, "SOFTCAP_IN_KERNEL", True)
    monkeypatch.setattr(gluon_forward, "_arch", lambda index: 90)
    monkeypatch.setattr(torch.Tensor, "is_cuda", property(lambda t: True))
    return recorded


def _plain(batch=2, sq=300, sk=500, heads=8, heads_k=2, d=128):
    return (torch.randn(batch, sq, heads, d, dtype=BF16), torch.randn(batch, sk, heads_k, d, dtype=BF16),
            torch.randn(batch, sk, heads_k, d, dtype=BF16))


def _packed(d=128):
    cu_q = torch.tensor([0, 5, 305], dtype=torch.int32)
    cu_k = torch.tensor([0, 7, 507], dtype=torch.int32)
    return (torch.randn(305, 8, d, dtype=BF16), torch.randn(507, 2, d, dtype=BF16), torch.randn(507, 2, d, dtype=BF16),
            cu_q, cu_k)


def _calls(route, d, causal):
    """(call(softcap, softcap_approx), the variant the call dispatches without a softcap) of one launch
    route."""
    if route in ("plain", "general"):
        q, k, v = _plain(d=d)
        variant = gluon_forward.dispatch_variant(d, "bf16", causal, 500)
        if route == "plain":
            return (lambda cap, approx=False: gluon_forward.plain_forward(q, k, v, SCALE, causal, softcap=cap,
                                                                          softcap_approx=approx)), variant
        return (lambda cap, approx=False: gluon_forward.gluon_attention_forward(
            q, k, v, softmax_scale=SCALE, causal=causal, softcap=cap, softcap_approx=approx)), variant
    q, k, v, cu_q, cu_k = _packed(d)
    variant = gluon_forward.with_varlen(gluon_forward.dispatch_variant(d, "bf16", causal, 500))
    if route == "packed":
        return (lambda cap, approx=False: gluon_forward.packed_forward(q, k, v, cu_q, cu_k, 300, 500, SCALE, causal,
                                                                       softcap=cap, softcap_approx=approx)), variant
    return (lambda cap, approx=False: gluon_forward.gluon_varlen_forward(
        q, k, v, cu_q, cu_k, 300, 500, softmax_scale=SCALE, causal=causal, softcap=cap,
        softcap_approx=approx)), variant


@pytest.mark.parametrize("approx", [False, True], ids=["formula", "tanh-approx"])
@pytest.mark.parametrize("route", ["plain", "general", "packed", "varlen"])
@pytest.mark.parametrize("d, causal", [(64, True), (128, False), (256, True)])
def test_softcap_launches_the_softcap_variant_with_its_scalars(launches, route, d, causal, approx):
    """With a softcap the launch runs the dispatched variant with ``softcap`` (one of the compile-checked
    GLUON_VARIANTS, work-listed or not; SOFTCAP 1, the exp2 formula, or 2, tanh.approx, with
    ``softcap_approx``), its score scale softcap * log2(e) and, as the last scalar, softmax_scale /
    softcap (the kernel's tanh argument); without one, the variant without it, the scale in log2 units
    and 0.0 there."""
    call, variant = _calls(route, d, causal)
    call(CAP, approx)
    call(0.0, approx)
    (_, _, _, scalars, options, _), (_, _, _, plain_scalars, plain_options, _) = launches
    assert options["SOFTCAP"] == (2 if approx else 1) and not plain_options["SOFTCAP"]
    names = [n for n in gluon_forward._attn_fwd_gluon.arg_names if n not in options]
    scalar_names = names[len(names) - len(scalars):]
    assert scalar_names[-1] == "softcap_in" and "qk_scale" in scalar_names
    at = scalar_names.index("qk_scale")
    assert scalars[at] == pytest.approx(CAP * LOG2E) and scalars[-1] == pytest.approx(SCALE / CAP)
    assert plain_scalars[at] == pytest.approx(SCALE * LOG2E) and plain_scalars[-1] == 0.0
    assert isinstance(scalars[-1], float) and isinstance(plain_scalars[-1], float)  # (one launcher key class)
    launched = [v for v in gluon_forward.GLUON_VARIANTS if gluon_forward._launch_options(v) is options]
    assert launched and all(v.softcap and v.softcap_approx == approx for v in launched)
    base = [v for v in gluon_forward.GLUON_VARIANTS if gluon_forward._launch_options(v) is plain_options]
    assert base and gluon_forward.with_softcap(base[0], approx) == launched[0]
    assert base[0].name.replace("-wl", "") == variant.name


def test_softcap_variants_are_16_bit():
    with pytest.raises(ValueError, match="softcap"):
        gluon_forward.with_softcap(gluon_forward.default_variant(128, "fp8", False))
    assert gluon_forward.with_softcap(gluon_forward.default_variant(128, "bf16", False)).name.endswith(
        "-softcap")
    assert gluon_forward.with_softcap(gluon_forward.default_variant(128, "bf16", False), approx=True).name.endswith(
        "-softcap-approx")


def test_softcap_refusals(launches):
    """A softcap with seqused_k (plain calls), e4m3 inputs or below 0 is turned away before any launch: ``supported``
    says no, the plans give None, the direct launches raise."""
    q, k, v = _plain()
    assert gluon_forward.supported(q, k, v, causal=True, softcap=CAP)
    assert gluon_forward.supported(q, k, v, causal=True, softcap=CAP, window_size=(128, 0))
    assert not gluon_forward.supported(q, k, v, causal=True, softcap=-1.0)
    with pytest.raises(ValueError, match="softcap"):
        gluon_forward.gluon_attention_forward(q, k, v, softmax_scale=SCALE, causal=True, softcap=CAP,
                                              seqused_k=torch.full((2,), 400, dtype=torch.int32))
    with pytest.raises(ValueError, match="softcap"):
        gluon_forward.gluon_attention_forward(q, k, v, softmax_scale=SCALE, causal=True, softcap=-2.0)
    q_p, k_p, v_p, cu_q, cu_k = _packed()
    with pytest.raises(ValueError, match="softcap"):
        gluon_forward.gluon_varlen_forward(q_p, k_p, v_p, cu_q, cu_k, 300, 500, softmax_scale=SCALE, causal=True,
                                           softcap=-1.0)
    with pytest.raises(ValueError, match="softcap"):
        gluon_forward.gluon_varlen_forward(q_p.to(torch.float8_e4m3fn), k_p.to(torch.float8_e4m3fn),
                                           v_p.to(torch.float8_e4m3fn), cu_q, cu_k, 300, 500, softmax_scale=SCALE,
                                           causal=True, softcap=CAP, descales=(None, None, None))
    lengths = torch.full((2,), 400, dtype=torch.int32)
    assert gluon_forward.plain_forward(q, k, v, SCALE, True, seqused_k=lengths, softcap=CAP) is None
    assert gluon_forward.plain_forward(q, k, v, SCALE, True, softcap=-1.0) is None
    assert gluon_forward.packed_forward(q_p, k_p, v_p, cu_q, cu_k, 300, 500, SCALE, True, softcap=-1.0) is None
    assert not launches
    gluon_forward.SOFTCAP_IN_KERNEL = False  # (the fixture restores it)
    assert not gluon_forward.supported(q, k, v, causal=True, softcap=CAP)


class ReachedPortable(Exception):
    """The call got past every Gluon route to the portable kernel's launch."""


def _portable_reached(*args, **kwargs):
    raise ReachedPortable


@pytest.mark.parametrize("forward_only, approx_switch, training_approx",
                         [(False, True, False), (True, True, False), (True, False, False), (False, False, True)],
                         ids=["with-backward", "forward-only", "forward-only-switched-off", "training-approx"])
@pytest.mark.parametrize("switch", [True, False])
@pytest.mark.parametrize("route", ["plain", "general", "packed", "packed-general", "pools"])
def test_attention_forward_hands_the_softcap_to_the_gluon_routes(monkeypatch, route, switch, forward_only,
                                                                 approx_switch, training_approx):
    """attention_forward gives a softcapped 16-bit call to the Gluon routes with the softcap where
    SOFTCAP_IN_KERNEL (plain calls, packed sequences, contiguous or on page pools), and otherwise goes
    on to the portable kernel's launch without asking them; tanh.approx (``softcap_approx``) for a
    forward-only call with SOFTCAP_APPROX, and for a training call told to take it (whatever
    SOFTCAP_APPROX says), the portable launch then too (SOFTCAP 2)."""
    monkeypatch.setattr(gluon_forward, "SOFTCAP_IN_KERNEL", switch)
    monkeypatch.setattr(gluon_forward, "SOFTCAP_APPROX", approx_switch)
    if route.startswith("packed") or route == "pools":
        cu_q = torch.tensor([0, 5, 30], dtype=torch.int32)
        cu_k = torch.tensor([0, 7, 47], dtype=torch.int32)
        q, k, v = (torch.randn(n, h, 64, dtype=BF16) for n, h in ((30, 4), (47, 2), (47, 2)))
        kw = dict(softmax_scale=SCALE, window_left=-1, window_right=0, diag_offset=0, cu_seqlens_q=cu_q,
                  cu_seqlens_k=cu_k, max_seqlen_q=25, max_seqlen_k=40)
        if route == "pools":
            k, v = (torch.randn(6, 16, 2, 64, dtype=BF16) for _ in range(2))
            kw["block_table"] = torch.tensor([[0, 1, 2], [3, 4, 5]], dtype=torch.int32)
    else:
        q, k, v = _plain(2, 30, 41, 4, 2, 64)
        kw = dict(softmax_scale=SCALE, window_left=-1, window_right=0, diag_offset=11)
    given = []
    result = (torch.zeros(1), torch.zeros(1))

    def stand_in(*args, **kwargs):
        given.append((kwargs.get("softcap"), kwargs.get("softcap_approx")))
        return result

    def portable(*args, **kwargs):
        given.append(("portable", args[19]))  # (has_softcap: the kernel's SOFTCAP)
        raise ReachedPortable
    monkeypatch.setattr(forward, "_PLAIN_GLUON", True)
    monkeypatch.setattr(forward, "_INTERPRET", False)
    monkeypatch.setattr(forward, "GLUON_ENABLED", True)
    monkeypatch.setattr(forward, "_launch_forward", portable)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: None)  # q.device.index on a CPU
    monkeypatch.setattr(torch.Tensor, "is_cuda", property(lambda t: True))
    monkeypatch.setattr(forward, "split_keys_wanted", lambda *args: False)
    monkeypatch.setattr(gluon_forward, "_sm_count", lambda device: 132)
    if route == "plain":
        monkeypatch.setattr(gluon_forward, "plain_forward", stand_in)
    elif route == "general":
        monkeypatch.setattr(gluon_forward, "plain_forward", lambda *args, **kwargs: None)
        monkeypatch.setattr(gluon_forward, "supported", lambda *args, **kwargs: kwargs.get("softcap") == CAP)
        monkeypatch.setattr(gluon_forward, "gluon_attention_forward", stand_in)
    elif route == "packed":
        monkeypatch.setattr(gluon_forward, "packed_forward", stand_in)
    else:  # (page pools skip the plan route: block_table)
        monkeypatch.setattr(gluon_forward, "packed_forward", lambda *args, **kwargs: None)
        monkeypatch.setattr(gluon_forward, "varlen_supported", lambda *args, **kwargs: True)
        monkeypatch.setattr(gluon_forward, "gluon_varlen_forward", stand_in)
    kw.update(softcap=CAP, forward_only=forward_only, softcap_approx=training_approx)
    if switch:
        assert forward.attention_forward(q, k, v, **kw) is result
        assert given == [(CAP, training_approx or forward_only and approx_switch)]
    else:
        with pytest.raises(ReachedPortable):
            forward.attention_forward(q, k, v, **kw)
        assert given == [("portable", 2 if training_approx else True)]


@pytest.mark.parametrize("packed", [False, True])
@pytest.mark.parametrize("d, causal, window", [(128, True, (1024, 0)), (256, False, (512, 300))])
def test_windowed_softcap_launches_the_window_softcap_variant(launches, packed, d, causal, window):
    """Gemma 2's local layers: a sliding window with the softcap runs the window variant with
    ``softcap`` (compile-checked in GLUON_VARIANTS), the window's sides and the softcap's scalars."""
    if packed:
        q, k, v, cu_q, cu_k = _packed(d)
        gluon_forward.gluon_varlen_forward(q, k, v, cu_q, cu_k, 300, 500, softmax_scale=SCALE, causal=causal,
                                           softcap=CAP, window_size=window)
    else:
        q, k, v = _plain(d=d)
        gluon_forward.gluon_attention_forward(q, k, v, softmax_scale=SCALE, causal=causal, softcap=CAP,
                                              window_size=window)
    ((_, _, _, scalars, options, _),) = launches
    assert options["SOFTCAP"] and options["WINDOW"]
    assert scalars[-3:-1] == gluon_forward.window_arguments(causal, window)
    assert scalars[-1] == pytest.approx(SCALE / CAP)
    launched = [v for v in gluon_forward.GLUON_VARIANTS if gluon_forward._launch_options(v) is options]
    assert launched and all(v.softcap and v.window for v in launched)


@pytest.mark.parametrize("page", [16, 256])
@pytest.mark.parametrize("d, causal", [(64, False), (128, True), (256, True)])
def test_packed_softcap_on_page_pools_launches_the_paged_softcap_variant(launches, page, d, causal):
    """vLLM's prefill for Gemma 2: packed sequences on page pools with the softcap run the paged
    variant with ``softcap`` (compile-checked in GLUON_VARIANTS) and the softcap's scalars."""
    pages = 2 * -(-500 // page)
    pools = torch.randn(pages, page, 2, d, dtype=BF16)
    table = torch.randperm(pages, dtype=torch.int32).view(2, -1).contiguous()
    q, _, _, cu_q, cu_k = _packed(d)
    gluon_forward.gluon_varlen_forward(q, pools, pools, cu_q, cu_k, 300, 500, softmax_scale=SCALE, causal=causal,
                                       softcap=CAP, block_table=table)
    ((_, _, _, scalars, options, _),) = launches
    assert options["SOFTCAP"] and options["SEQUSED_K"] and options["VARLEN"]
    assert scalars[-1] == pytest.approx(SCALE / CAP)
    launched = [v for v in gluon_forward.GLUON_VARIANTS if gluon_forward._launch_options(v) is options]
    assert launched and all(v.softcap and v.seqused_k for v in launched)


def _benchmark_script(name: str):
    """benchmarks/<name>.py loaded as a module."""
    import importlib.util
    from pathlib import Path

    path = Path(__file__).resolve().parents[1] / "benchmarks" / f"{name}.py"
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_softcap_check_script_runs_its_checks(tmp_path, capsys):
    """benchmarks/softcap_check.py (the H200's check of the softcap in the kernel) runs its float64
    checks through the interpreter (the portable kernel there): every case within the rule, and the
    switch back as it was."""
    import json

    before = gluon_forward.SOFTCAP_IN_KERNEL
    module = _benchmark_script("softcap_check")
    assert module.main(["--smoke", "--out", str(tmp_path)]) == 0
    checks = json.loads((tmp_path / "softcap-check.json").read_text())["checks"]
    assert {c["case"] for c in checks} == {"plain", "packed", "pools", "train"}
    assert all(0 < c["of_budget"] <= 1 for c in checks)
    assert gluon_forward.SOFTCAP_IN_KERNEL == before


def test_softcap_train_script_runs_its_checks(tmp_path, monkeypatch):
    """benchmarks/softcap_train.py (the GPU check and timing of the fused backward's softcap) runs its
    gradient checks through the interpreter (the portable backward there, as the checks expect), and
    a wrong gradient fails them."""
    import json
    from flashtile import ops

    module = _benchmark_script("softcap_train")
    assert module.main(["--smoke", "--out", str(tmp_path)]) == 0
    checks = json.loads((tmp_path / "softcap-train-smoke.json").read_text())["checks"]
    assert len(checks) == len(module.SMOKE_CHECKS) and all(c["ok"] and not c["fused_launches"] for c in checks)
    real = ops.attention_backward

    def off(*args, **kwargs):
        dq, dk, dv = real(*args, **kwargs)
        return dq, dk * 1.01, dv
    monkeypatch.setattr(ops, "attention_backward", off)
    assert module.main(["--smoke"]) == 1


def test_short_softcapped_queries_on_long_keys_take_the_split_kv_decode_with_the_softcap(monkeypatch):
    """A plain call that split_keys_wanted sends to the split-KV decode (few query rows on many keys)
    keeps its softcap there (the decode kernels take it; the KV-cache tests check them)."""
    from flashtile.kernels import decode
    monkeypatch.setattr(gluon_forward, "SOFTCAP_IN_KERNEL", True)
    monkeypatch.setattr(forward, "_PLAIN_GLUON", True)
    monkeypatch.setattr(torch.Tensor, "is_cuda", property(lambda t: True))
    monkeypatch.setattr(forward, "split_keys_wanted", lambda *args: True)
    monkeypatch.setattr(forward, "key_counts", lambda batch, keys, device: torch.full((batch,), keys))
    monkeypatch.setattr(gluon_forward, "_sm_count", lambda device: 132)
    monkeypatch.setattr(gluon_forward, "plain_plan", lambda *args, **kwargs: "plan")
    asked = []
    monkeypatch.setattr(decode, "decode_attention", lambda *args, **kwargs: asked.append(kwargs) or "decoded")
    q, k, v = _plain(1, 4, 3000, 8, 2, 128)
    assert forward.attention_forward(q, k, v, softmax_scale=SCALE, window_left=-1, window_right=0,
                                     diag_offset=2996, softcap=CAP) == "decoded"
    assert asked[0]["softcap"] == CAP and asked[0]["window_right"] == 0


def test_training_calls_with_tanh_approx_stay_off_the_split_kv_decode(monkeypatch):
    """The same call told to take tanh.approx in a training step (``softcap_approx``) goes to the
    Gluon prefill instead: the decode kernels take the softcap by exp2's formula only, which the
    backward's tanh.approx would not match."""
    from flashtile.kernels import decode
    monkeypatch.setattr(gluon_forward, "SOFTCAP_IN_KERNEL", True)
    monkeypatch.setattr(forward, "_PLAIN_GLUON", True)
    monkeypatch.setattr(torch.Tensor, "is_cuda", property(lambda t: True))
    monkeypatch.setattr(forward, "split_keys_wanted", lambda *args: True)
    monkeypatch.setattr(gluon_forward, "_sm_count", lambda device: 132)
    monkeypatch.setattr(gluon_forward, "plain_plan", lambda *args, **kwargs: "plan")
    monkeypatch.setattr(decode, "decode_attention", lambda *args, **kwargs: pytest.fail("decode route taken"))
    asked = []
    monkeypatch.setattr(gluon_forward, "plain_forward", lambda *args, **kwargs: asked.append(kwargs) or "prefill")
    q, k, v = _plain(1, 4, 3000, 8, 2, 128)
    assert forward.attention_forward(q, k, v, softmax_scale=SCALE, window_left=-1, window_right=0,
                                     diag_offset=2996, softcap=CAP, softcap_approx=True) == "prefill"
    assert asked[0]["softcap"] == CAP and asked[0]["softcap_approx"] is True


def test_softcap_approx_in_training_rule(monkeypatch):
    """forward.softcap_approx_in_training: a softcap, a CUDA tensor of an sm_90 device, outside the
    interpreter, with SOFTCAP_APPROX_TRAIN; nothing else (the device's answers stubbed)."""
    q = torch.randn(1, 4, 2, 64, dtype=BF16)
    assert not forward.softcap_approx_in_training(q, CAP)  # a CPU tensor
    monkeypatch.setattr(torch.Tensor, "is_cuda", property(lambda t: True))
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(forward, "_INTERPRET", False)
    arch = [90]
    monkeypatch.setattr(forward, "_arch", lambda index: arch[0])
    assert forward.softcap_approx_in_training(q, CAP)
    assert not forward.softcap_approx_in_training(q, 0.0)
    arch[0] = 80
    assert not forward.softcap_approx_in_training(q, CAP)
    arch[0] = 90
    monkeypatch.setattr(forward, "SOFTCAP_APPROX_TRAIN", False)
    assert not forward.softcap_approx_in_training(q, CAP)
    monkeypatch.setattr(forward, "SOFTCAP_APPROX_TRAIN", True)
    monkeypatch.setattr(forward, "_INTERPRET", True)
    assert not forward.softcap_approx_in_training(q, CAP)


def test_training_calls_tell_the_forward_and_the_backward_the_same_tanh(monkeypatch):
    """ops: a call with gradients asks softcap_approx_in_training and gives its answer to the forward
    (attention_forward's ``softcap_approx``) and to the backward (attention_backward's), eager and
    compiled; a call without gradients gives the forward none (it is forward-only). The rule stubbed
    to say yes; the kernels run with exp2's formula (the interpreter has no tanh.approx)."""
    import flashtile
    from flashtile import ops

    told = []
    real_forward, real_backward = ops.attention_forward, ops.attention_backward

    def forward_told(*args, **kwargs):
        told.append(("fwd", kwargs["softcap_approx"]))
        return real_forward(*args, **{**kwargs, "softcap_approx": False})

    def backward_told(*args, **kwargs):
        told.append(("bwd", kwargs["softcap_approx"]))
        return real_backward(*args, **{**kwargs, "softcap_approx": False})
    monkeypatch.setattr(ops, "attention_forward", forward_told)
    monkeypatch.setattr(ops, "attention_backward", backward_told)
    monkeypatch.setattr(ops, "softcap_approx_in_training", lambda q, softcap: softcap > 0)
    q, k, v = _plain(1, 16, 24, 4, 2, 32)

    def call(q, k, v, softcap=CAP):
        return flashtile.flash_attn_func(q, k, v, causal=True, softcap=softcap)
    with torch.no_grad():
        call(q, k, v)
    assert told == [("fwd", False)]
    told.clear()
    grads = [t.clone().requires_grad_(True) for t in (q, k, v)]
    call(*grads).sum().backward()
    call(*grads, softcap=0.0).sum().backward()
    assert told == [("fwd", True), ("bwd", True), ("fwd", False), ("bwd", False)]
    told.clear()
    torch.compile(call, fullgraph=True)(*grads).sum().backward()
    assert told == [("fwd", True), ("bwd", True)]


def test_calls_without_gradients_are_forward_only(monkeypatch):
    """ops.forward marks calls no backward follows as forward-only (what lets the Gluon forward take
    tanh.approx): eager calls without gradients and compiled ones whose inputs need none; calls whose
    inputs require grad, eager or compiled, are not."""
    import flashtile
    from flashtile import ops

    asked = []
    real = ops.attention_forward

    def recording(*args, **kwargs):
        asked.append(kwargs.get("forward_only"))
        return real(*args, **kwargs)
    monkeypatch.setattr(ops, "attention_forward", recording)
    q, k, v = _plain(1, 16, 24, 4, 2, 32)

    def call(q, k, v):
        return flashtile.flash_attn_func(q, k, v, causal=True, softcap=CAP)
    with torch.no_grad():
        call(q, k, v)
    call(q, k, v)
    assert asked == [True, True]
    asked.clear()
    grads = [t.clone().requires_grad_(True) for t in (q, k, v)]
    call(*grads).sum().backward()
    assert asked == [False]
    asked.clear()
    compiled = torch.compile(call, fullgraph=True)
    compiled(q, k, v)
    compiled(*grads).sum().backward()
    assert asked == [True, False]
