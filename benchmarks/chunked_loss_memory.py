"""Peak memory and step time of one training step with whole logits vs the chunked cross-entropy (issue 14), ours
(ChunkedCrossEntropy) and torch's own F.linear_cross_entropy with its chunking options (torch 2.13; issue 26).

    python benchmarks/chunked_loss_memory.py                  # CPU: a tiny Llama with Llama-3's 128,256-token vocabulary
    python benchmarks/chunked_loss_memory.py --device cuda    # GPU: peak allocated CUDA memory instead of peak RSS

Each mode runs in a fresh process (peak RSS is a per-process high-water mark). The memory attributable to the loss
is the step's peak minus the peak of the same step in a process whose loss never builds logits (the hidden states'
sum, with the output layer's weight still receiving a gradient and optimizer state): what remains is the logits, their
gradient and cross-entropy's buffers. Step time: the median of 3 steps after one warm-up step, in the same process.
"""

from __future__ import annotations

import json

import memory_harness  # benchmarks/, the script's own folder

MODES = ("no_logits", "full_logits", "chunked", "torch_linear_ce")


def child(mode: str, args) -> dict:
    import torch
    from transformers import AutoModelForCausalLM, LlamaConfig

    from fsdp_recipes.data.rows import IGNORE_INDEX
    from fsdp_recipes.train.losses import TokenLoss, torch_kernel_options

    if mode == "torch_linear_ce" and torch_kernel_options(args.chunk) is None:
        return {"mode": mode, "peak_bytes": 0, "step_s": 0.0, "loss": "unavailable in this torch"}

    torch.manual_seed(0)
    device = torch.device(args.device)
    config = LlamaConfig(
        vocab_size=args.vocab,
        hidden_size=args.hidden,
        intermediate_size=2 * args.hidden,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=args.tokens,
    )
    model = AutoModelForCausalLM.from_config(config, attn_implementation="sdpa").to(device)
    implementation = {"no_logits": "full_logits", "torch_linear_ce": "linear_cross_entropy"}.get(mode, mode)
    loss = TokenLoss(model, implementation, chunk_size=args.chunk)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    ids = torch.randint(0, args.vocab, (args.rows, args.tokens), device=device)
    positions = torch.arange(args.tokens, device=device).repeat(args.rows, 1)
    targets = torch.roll(ids, -1, dims=1)
    targets[:, -1] = IGNORE_INDEX
    batch = {"input_ids": ids, "position_ids": positions, "targets": targets}

    def step():
        if mode == "no_logits":
            hidden = model.model(input_ids=ids, position_ids=positions, use_cache=False).last_hidden_state
            value = hidden.float().sum() + 0.0 * model.lm_head.weight.sum()
        else:
            value = loss.loss_sum(model, batch)
        value.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    peak, step_s = memory_harness.peak_and_step_time(step, device)
    return {"mode": mode, "peak_bytes": peak, "step_s": step_s, "loss": loss.description}


def main() -> None:
    args = memory_harness.parser(__doc__, rows=4).parse_args()
    if args.child:
        print(json.dumps(child(args.child, args)))
        return
    results = memory_harness.each_mode_in_a_fresh_process(__file__, MODES)
    base = results["no_logits"]["peak_bytes"]
    whole, chunked, torch_kernel = results["full_logits"], results["chunked"], results["torch_linear_ce"]
    report = {
        "setup": f"{args.rows} x {args.tokens} tokens, vocabulary {args.vocab}, hidden {args.hidden}, {args.device}",
        "peak_gib": {mode: round(r["peak_bytes"] / 2**30, 3) for mode, r in results.items()},
        "loss_share_gib": {
            "full_logits": round((whole["peak_bytes"] - base) / 2**30, 3),
            "chunked": round((chunked["peak_bytes"] - base) / 2**30, 3),
            "torch_linear_ce": round((torch_kernel["peak_bytes"] - base) / 2**30, 3)
            if torch_kernel["step_s"]
            else None,
        },
        "step_s": {mode: round(r["step_s"], 4) for mode, r in results.items()},
    }
    report["loss_share_ratio"] = round((chunked["peak_bytes"] - base) / max(whole["peak_bytes"] - base, 1), 4)
    report["step_time_ratio"] = round(chunked["step_s"] / whole["step_s"], 3)
    if args.json:
        print(json.dumps(report))
        return
    print(report["setup"])
    for mode in MODES:
        print(f"  {mode:12s} peak {report['peak_gib'][mode]:7.3f} GiB   step {report['step_s'][mode] * 1e3:8.1f} ms")
    print(
        f"memory of the loss: whole logits {report['loss_share_gib']['full_logits']:.3f} GiB, chunked "
        f"{report['loss_share_gib']['chunked']:.3f} GiB ({report['loss_share_ratio']:.1%} of whole)"
    )
    print(f"chunked step time / whole-logits step time: {report['step_time_ratio']:.3f}")
    if torch_kernel["step_s"]:
        print(
            f"torch's F.linear_cross_entropy: loss memory {report['loss_share_gib']['torch_linear_ce']:.3f} GiB, step "
            f"time {torch_kernel['step_s'] / chunked['step_s']:.3f} x ours"
        )
    else:
        print("torch's F.linear_cross_entropy with chunking options: not in this torch")


if __name__ == "__main__":
    main()
