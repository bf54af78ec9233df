"""attn_implementation="flashtile" in Hugging Face transformers, on tiny random models through the
interpreter: logits and gradients against eager attention in float32 (the budget is 2x, for gradients
3x, the error of eager attention in bf16), prefill, padding, packed sequences and greedy decoding."""

from __future__ import annotations

import copy

import pytest
import torch

transformers = pytest.importorskip("transformers")  # an optional extra; `make test` installs it
from flashtile.integrations.transformers import NAME  # noqa: E402  (importing registers it)
from transformers import (AutoModelForCausalLM, Gemma2Config, GptOssConfig, LlamaConfig,  # noqa: E402
                          MistralConfig, Qwen2Config)

SMALL = dict(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
             num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256)
CONFIGS = {
    "llama": lambda: LlamaConfig(**SMALL),
    "qwen2": lambda: Qwen2Config(**SMALL),
    "mistral-window": lambda: MistralConfig(**SMALL, sliding_window=8),
    "gemma2-softcap": lambda: Gemma2Config(**SMALL, head_dim=16, sliding_window=8,
                                           attn_logit_softcapping=20.0, final_logit_softcapping=30.0,
                                           query_pre_attn_scalar=16),
    # attention sinks (s_aux), alternating sliding and full layers, head_dim 16; every token takes
    # both experts, so that no rounding flips a discrete expert choice between implementations
    "gpt-oss-sinks": lambda: GptOssConfig(**dict(SMALL, intermediate_size=64), head_dim=16, num_local_experts=2,
                                          num_experts_per_tok=2, sliding_window=8,
                                          layer_types=["sliding_attention", "full_attention"]),
}


def models(name: str):
    """(flashtile bf16, eager bf16, eager fp32) with the same weights, the fp32 ones rounded to bf16."""
    config = CONFIGS[name]()
    ref = AutoModelForCausalLM.from_config(copy.deepcopy(config), attn_implementation="eager",
                                           dtype=torch.float32)
    with torch.no_grad():
        for n, p in ref.named_parameters():
            if n.endswith(".sinks"):  # gpt-oss's learned sinks, spread so that they matter (init: ~0)
                p.normal_(0.0, 2.0)
    ref.load_state_dict({k: v.to(torch.bfloat16).float() for k, v in ref.state_dict().items()})
    out = []
    for impl in (NAME, "eager"):
        m = AutoModelForCausalLM.from_config(copy.deepcopy(config), attn_implementation=impl,
                                             dtype=torch.bfloat16)
        m.load_state_dict({k: v.to(torch.bfloat16) for k, v in ref.state_dict().items()})
        out.append(m)
    assert out[0].config._attn_implementation == NAME == "flashtile"
    return out[0], out[1], ref


def assert_close(got, low, exact, factor=2.0, what="logits"):
    err = (got.float() - exact).abs().max().item()
    budget = max(factor * (low.float() - exact).abs().max().item(),
                 torch.finfo(torch.bfloat16).eps * exact.abs().max().item())
    assert err <= budget, f"{what}: max error {err:.3g} > {factor:g}x eager bf16 ({budget:.3g})"


def logits(model, ids, **kw):
    with torch.no_grad():
        return model(ids, **kw).logits


@pytest.mark.parametrize("name", list(CONFIGS))
def test_prefill_matches_eager(name):
    ft, low, ref = models(name)
    ids = torch.randint(0, 128, (2, 24))
    assert_close(logits(ft, ids), logits(low, ids), logits(ref, ids))


@pytest.mark.parametrize("side", ["left", "right"])
@pytest.mark.parametrize("name", ["llama", "mistral-window"])
def test_padding_runs_packed(name, side):
    ft, low, ref = models(name)
    ids = torch.randint(0, 128, (3, 20))
    mask = torch.ones(3, 20, dtype=torch.long)
    pad = slice(0, 7) if side == "left" else slice(13, 20)
    mask[0, pad] = 0
    mask[2, slice(0, 2) if side == "left" else slice(18, 20)] = 0
    real = mask.bool()
    got, lo, exact = (logits(m, ids, attention_mask=mask) for m in (ft, low, ref))
    assert_close(got[real], lo[real], exact[real])


@pytest.mark.parametrize("padded", [False, True], ids=["unpadded", "left-padded"])
@pytest.mark.parametrize("name", ["llama", "gemma2-softcap", "gpt-oss-sinks"])
def test_greedy_decode_eight_steps(name, padded):
    """The logits of each decode step (KV cache, split-KV kernel when unpadded) against eager fp32
    on the generated sequence, teacher-forced."""
    ft, low, ref = models(name)
    ids = torch.randint(3, 128, (2, 12))
    mask = torch.ones(2, 12, dtype=torch.long)
    if padded:
        mask[1, :4] = 0
    with torch.no_grad():
        # min_new_tokens: a random model may emit its EOS token and end the generation early
        gen = ft.generate(ids, attention_mask=mask, max_new_tokens=8, min_new_tokens=8, do_sample=False,
                          output_logits=True, return_dict_in_generate=True, pad_token_id=0)
    seq = gen.sequences
    assert seq.shape == (2, 20)
    full_mask = torch.cat([mask, torch.ones(2, 8, dtype=torch.long)], dim=1)
    exact = logits(ref, seq, attention_mask=full_mask)[:, 11:19]
    lo = logits(low, seq, attention_mask=full_mask)[:, 11:19]
    got = torch.stack(gen.logits, dim=1)
    assert_close(got, lo, exact, what="decode logits")


@pytest.mark.parametrize("name", ["llama", "mistral-window", "gpt-oss-sinks"])
def test_training_gradients(name):
    ft, low, ref = models(name)
    ids = torch.randint(0, 128, (2, 24))
    mask = torch.ones(2, 24, dtype=torch.long)
    mask[1, 18:] = 0
    labels = ids.masked_fill(mask == 0, -100)  # padding rows are not part of the loss
    grads = []
    for m in (ft, low, ref):
        m.train()
        m.zero_grad()
        m(ids, attention_mask=mask, labels=labels).loss.backward()
        grads.append({n: p.grad for n, p in m.named_parameters() if "self_attn" in n})
    assert grads[0] and all(g is not None and torch.isfinite(g).all() for g in grads[0].values())
    for n in grads[0]:
        if n.endswith(".sinks"):
            # A sink's gradient is a sum over the rows of dO . O with O as stored in bf16, as
            # FlashAttention's D is, and its terms nearly cancel: its error is the algorithm's, which
            # eager attention (softmax gradient in float32) does not have, and the model gives
            # nothing to price it by. test_sinks checks it by the accuracy rule with that term; here
            # the sinks' gradients must reach the parameters and agree to 10% of their scale.
            err = (grads[0][n].float() - grads[2][n]).abs().max().item()
            low_err = (grads[1][n].float() - grads[2][n]).abs().max().item()
            assert err <= max(3 * low_err, 0.1 * grads[2][n].abs().max().item()), (n, err, low_err)
            continue
        assert_close(grads[0][n], grads[1][n], grads[2][n], factor=3.0, what=f"grad {n}")


def test_packed_sequences_from_position_ids():
    """One row holding two sequences, position_ids restarting at 0: each sequence as if alone."""
    ft, _, _ = models("llama")
    a, b = torch.randint(0, 128, (1, 9)), torch.randint(0, 128, (1, 14))
    packed = torch.cat([a, b], dim=1)
    position_ids = torch.cat([torch.arange(9), torch.arange(14)]).unsqueeze(0)
    got = logits(ft, packed, position_ids=position_ids)
    alone = torch.cat([logits(ft, a), logits(ft, b)], dim=1)
    torch.testing.assert_close(got.float(), alone.float(), atol=2e-2, rtol=0)


def test_what_it_cannot_honour_is_an_error():
    ft, _, _ = models("llama")
    ids = torch.randint(0, 128, (1, 10))
    with pytest.raises(NotImplementedError, match="attention weights"):
        ft(ids, output_attentions=True)
    holes = torch.ones(1, 10, dtype=torch.long)
    holes[0, 4] = 0
    with pytest.raises(ValueError, match="padding between real tokens"):
        ft(ids, attention_mask=holes)


def test_mask_is_read_once_per_forward(monkeypatch):
    """The host reads of a padding mask (a device sync each) happen once per forward, not per layer."""
    import flashtile.integrations.transformers as integration

    calls = []
    real = integration._padding_layout
    monkeypatch.setattr(integration, "_padding_layout", lambda *a: calls.append(a) or real(*a))
    ft, _, _ = models("llama")
    assert ft.config.num_hidden_layers == 2
    ids = torch.randint(0, 128, (2, 16))
    mask = torch.ones(2, 16, dtype=torch.long)
    mask[0, :5] = 0
    logits(ft, ids, attention_mask=mask)
    assert len(calls) == 1


def counted_decode_calls(monkeypatch):
    """The integration with an empty prepared-decode table, a list that counts its calls of the public
    flash_attn_with_kvcache, that function itself, and a causal bf16 module to call it for."""
    import flashtile.integrations.transformers as integration

    monkeypatch.setattr(integration, "_PREPARED_DECODE", {})
    public = []
    real = integration.interface.flash_attn_with_kvcache
    monkeypatch.setattr(integration.interface, "flash_attn_with_kvcache",
                        lambda *a, **k: public.append(1) or real(*a, **k))
    module = torch.nn.Linear(1, 1).to(torch.bfloat16)
    module.is_causal = True
    return integration, public, real, module


def test_decode_step_checks_a_signature_once(monkeypatch):
    """A decode call whose shapes, strides, dtypes and options were validated goes straight to the
    kernel, with the public function's result; a new signature is validated (and refused) again."""
    integration, public, real, module = counted_decode_calls(monkeypatch)

    def step(heads=4, heads_k=2, keys=37, dim=16):
        q = torch.randn(3, heads, 1, dim, dtype=torch.bfloat16)
        k, v = (torch.randn(3, heads_k, keys, dim, dtype=torch.bfloat16) for _ in range(2))
        with torch.no_grad():
            out, _ = integration.flashtile_attention_forward(module, q, k, v, None, scaling=0.3)
            expected = real(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), causal=True,
                            softmax_scale=0.3)
        return out, expected

    for calls in (1, 1, 1):
        out, expected = step()
        assert len(public) == calls  # the first call only
        assert torch.equal(out, expected)
    step(keys=38)
    assert len(public) == 2
    with pytest.raises(ValueError, match="multiple of the number of key/value heads"):
        step(heads=3)


def test_decode_step_with_sinks_takes_the_prepared_decode(monkeypatch):
    """gpt-oss's decode steps (s_aux given) take the prepared decode after the first validated call, with
    the public function's result; another sinks tensor of the same shape is read at each call."""
    integration, public, real, module = counted_decode_calls(monkeypatch)
    q = torch.randn(3, 4, 1, 16, dtype=torch.bfloat16)
    k, v = (torch.randn(3, 2, 37, 16, dtype=torch.bfloat16) for _ in range(2))
    # sinks near the rows' LSE (~log 37 + 1): each takes a share that shows in bf16
    for layer_sinks in (4 + torch.randn(4), 4 + torch.randn(4), (4 + torch.randn(4)).to(torch.bfloat16)):
        with torch.no_grad():
            out, _ = integration.flashtile_attention_forward(module, q, k, v, None, scaling=0.3, s_aux=layer_sinks)
            expected = real(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), causal=True,
                            softmax_scale=0.3, s_aux=layer_sinks)
            without = real(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), causal=True,
                           softmax_scale=0.3)
        assert torch.equal(out, expected) and not torch.equal(out, without)
    assert len(public) == 2  # the first float32 sinks' call and the first bf16 one
