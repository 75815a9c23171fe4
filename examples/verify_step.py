"""One MTP verify step of a GDN layer as a serving engine drives it, with libgdn.

Two KV-cache groups (each with its own block table and state pool), three requests verifying
num_spec + 1 = 3 tokens each. The step's metadata is built once (shared plan + one pass that fills
both groups' state rows); each group's GDN layer then runs decode_mtp straight from the builder's
arrays. Runs on the CPU, or on CUDA with --device cuda (needs a CUDA build of gdn and K = V = 128).

    python examples/verify_step.py [--device cuda]
"""

import argparse

import torch

import gdn

p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
p.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
args = p.parse_args()
dev = torch.device(args.device)
torch.manual_seed(0)

H, HV, K, V = 2, 4, 128, 128  # key heads, value heads (ratio 2), head dims
num_spec, N = 2, 3  # drafts per request, requests
S = num_spec + 1
G, blocks = 2, 32  # KV-cache groups, state slots per group's pool

# The engine's persistent block tables: request i owns S blocks per group (block 0 is the null block).
tables = [torch.randperm(blocks - 1, dtype=torch.int32)[: N * S].add(1).view(N, S).to(dev) for _ in range(G)]
builder = gdn.metadata.Builder(tables, num_spec=num_spec, max_rows=8, max_tokens=8 * S)

# This step: every request verifies S tokens; the previous step accepted 1, 3 and 2 tokens.
query_start_loc = torch.arange(0, N * S + 1, S, dtype=torch.int32)
seq_lens = torch.tensor([10, 17, 5], dtype=torch.int32)
md = builder.step(
    query_start_loc,
    seq_lens,
    num_draft_tokens=torch.full((N,), num_spec, dtype=torch.int32),
    num_accepted_tokens=torch.tensor([1, 3, 2], dtype=torch.int32),
    num_computed_tokens=seq_lens - S,
)
print("spec rows:", md.spec_rows, "| state rows of group 0:\n", md.spec_state_indices[0].cpu())

# One GDN layer per group: post-conv activations for the step's tokens, then decode_mtp.
L = N * S
for g in range(G):
    pool = 0.01 * torch.randn(blocks, HV, V, K, device=dev)  # fp32 state, "vk" layout
    mixed_qkv = torch.randn(L, 2 * H * K + HV * V, device=dev).bfloat16()
    ba = torch.randn(L, 2 * HV, device=dev).bfloat16()
    out = torch.empty(L, HV, V, device=dev, dtype=torch.bfloat16)
    gdn.decode_mtp(
        mixed_qkv,
        ba[:, HV:],
        ba[:, :HV],
        0.5 * torch.randn(HV, device=dev),
        0.1 * torch.randn(HV, device=dev),
        pool,
        out=out,
        z=torch.randn(L, HV, V, device=dev).bfloat16(),
        norm_weight=torch.ones(V, device=dev),
        first_valid_slot=1,
        **md.decode_mtp_args(g),
    )
    print(f"group {g}: out {tuple(out.shape)} finite={bool(out.float().isfinite().all())}")
