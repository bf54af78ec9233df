"""Random decode calls (contiguous and paged caches, appends, splits) against the reference.

    python tests/fuzz_decode.py SEED CASES       (CPU, interpreter; not part of the pytest run)
"""
import os, sys, random
os.environ["TRITON_INTERPRET"]="1"
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import torch, flashtile
from helpers import assert_matches_reference
seed = int(sys.argv[1]); n = int(sys.argv[2]); rng = random.Random(seed); torch.manual_seed(seed)
fails = 0
for case in range(n):
    B = rng.randint(1, 4); Hk = rng.choice([1, 2]); H = Hk * rng.choice([1, 3, 8]); Sq = rng.randint(1, 5)
    cap = rng.randint(Sq + 4, 260); d = rng.choice([16, 40, 64, 128]); dtype = rng.choice([torch.float16, torch.bfloat16])
    kw = {}
    if rng.random() < 0.6: kw["causal"] = True
    if rng.random() < 0.3: kw["window_size"] = (rng.randint(0, 80), -1)
    if rng.random() < 0.2: kw["softcap"] = 10.0
    q = torch.randn(B, Sq, H, d, dtype=dtype); kc = torch.randn(B, cap, Hk, d, dtype=dtype); vc = torch.randn_like(kc)
    lens = torch.randint(0, cap - 3, (B,), dtype=torch.int32)
    new = rng.choice([0, 1, 3])
    kn = torch.randn(B, new, Hk, d, dtype=dtype) if new else None; vn = torch.randn_like(kn) if new else None
    splits = rng.choice([0, 1, 2, 5])
    page = rng.choice([None, 1, 7, 16])
    sinks = torch.randn(H) * 3 if rng.random() < 0.3 else None  # attention sinks (s_aux)
    kw_call = dict(kw, s_aux=sinks) if sinks is not None else kw
    try:
        if page:
            per = -(-cap // page); npg = B * per + 2; order = torch.randperm(npg)[:B * per].view(B, per)
            kp = torch.randn(npg, page, Hk, d, dtype=dtype); vp = torch.randn_like(kp)
            for b in range(B):
                for j in range(per):
                    r = slice(j * page, min((j + 1) * page, cap)); kp[order[b, j], :r.stop - r.start] = kc[b, r]; vp[order[b, j], :r.stop - r.start] = vc[b, r]
            out, lse = flashtile.flash_attn_with_kvcache(q, kp, vp, kn, vn, cache_seqlens=lens, block_table=order.int(), num_splits=splits, return_softmax_lse=True, **kw_call)
            # rebuild contiguous view of what the pages hold now
            for b in range(B):
                for j in range(per):
                    r = slice(j * page, min((j + 1) * page, cap)); kc[b, r] = kp[order[b, j], :r.stop - r.start]; vc[b, r] = vp[order[b, j], :r.stop - r.start]
        else:
            out, lse = flashtile.flash_attn_with_kvcache(q, kc, vc, kn, vn, cache_seqlens=lens, num_splits=splits, return_softmax_lse=True, **kw_call)
        for b in range(B):
            L = int(lens[b]) + new
            assert_matches_reference(out[b:b+1], lse[b:b+1], q[b:b+1], kc[b:b+1, :L], vc[b:b+1, :L],
                                     **(dict(kw, sinks=sinks) if sinks is not None else kw))  # (sinks: inside)
    except Exception as e:
        fails += 1; print("FAIL", dict(B=B,H=H,Hk=Hk,Sq=Sq,cap=cap,d=d,dtype=dtype,new=new,splits=splits,page=page,sinks=sinks is not None,**kw), str(e)[:200], flush=True)
print(f"seed {seed}: {n} cases, {fails} failures")
