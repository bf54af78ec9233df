"""Random shapes and features through flash_attn_func forward+backward against the reference.

    python tests/fuzz_training.py SEED CASES     (CPU, interpreter; not part of the pytest run)
"""
import os, sys, random
os.environ["TRITON_INTERPRET"]="1"
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import torch, flashtile
from helpers import assert_matches_reference, assert_grads_match_reference
seed = int(sys.argv[1]); n = int(sys.argv[2])
rng = random.Random(seed); torch.manual_seed(seed)
fails = 0
for case in range(n):
    B = rng.randint(1, 3); Hk = rng.choice([1, 2, 3]); H = Hk * rng.choice([1, 2, 4])
    Sq = rng.randint(1, 120); Sk = rng.randint(1, 120); d = rng.choice([8, 16, 24, 40, 64, 72, 96, 128, 160])
    dtype = rng.choice([torch.float16, torch.bfloat16])
    kw = {}
    if rng.random() < 0.5: kw["causal"] = True
    if rng.random() < 0.3: kw["window_size"] = (rng.randint(-1, 60), rng.randint(-1, 60))
    if rng.random() < 0.2: kw["softcap"] = rng.choice([3.0, 20.0])
    if rng.random() < 0.2: kw["alibi_slopes"] = torch.rand(B, H) if rng.random() < 0.5 else torch.rand(H)
    sinks = torch.randn(H) * 3 if rng.random() < 0.3 else None  # attention sinks (s_aux)
    q = torch.randn(B, Sq, H, d, dtype=dtype); k = torch.randn(B, Sk, Hk, d, dtype=dtype); v = torch.randn_like(k)
    try:
        qq, kk, vv = (t.clone().requires_grad_(True) for t in (q, k, v))
        ss = None if sinks is None else sinks.clone().requires_grad_(True)
        out, lse, _ = flashtile.flash_attn_func(qq, kk, vv, return_attn_probs=True, s_aux=ss, **kw)
        ref_kw = dict(kw) if sinks is None else dict(kw, sinks=sinks)
        assert_matches_reference(out.detach(), lse.detach(), q, k, v, **ref_kw)  # (sinks: in the epilogue)
        dout = torch.randn_like(out)
        out.backward(dout)
        assert_grads_match_reference((qq.grad, kk.grad, vv.grad), q, k, v, dout, out=out.detach(), **ref_kw)
        if sinks is not None:  # ds_aux by test_sinks' rule (3x textbook, or 2x the stored output's D term)
            from flashtile.reference import attention
            grads = []
            for precision in (torch.float64, dtype):
                s_ = sinks.clone().requires_grad_(True)
                o, _ = attention(q.to(precision), k.to(precision), v.to(precision), sinks=s_, **kw)
                (o.double() * dout.double()).sum().backward()
                grads.append(s_.grad.double())
            ref, ref_lse = attention(q.double(), k.double(), v.double(), sinks=sinks, **kw)
            share = torch.exp(sinks.double().view(1, H, 1) - ref_lse)
            rounding = ((out.detach().double() - ref) * dout.double()).sum(-1).transpose(1, 2)
            stored_err = (share * rounding).nan_to_num().sum((0, 2)).abs().max().item()
            err = (ss.grad.double() - grads[0]).abs().max().item()
            low_err = (grads[1] - grads[0]).abs().max().item()
            assert err <= max(3 * low_err, 2 * stored_err, 1e-6), f"ds_aux: {err:.3g} ({low_err:.3g}, {stored_err:.3g})"
    except Exception as e:
        fails += 1
        print("FAIL", dict(B=B, H=H, Hk=Hk, Sq=Sq, Sk=Sk, d=d, dtype=dtype, sinks=sinks is not None, **{k2: (v2 if not torch.is_tensor(v2) else tuple(v2.shape)) for k2, v2 in kw.items()}), str(e)[:200], flush=True)
print(f"seed {seed}: {n} cases, {fails} failures")
