"""Peak memory and step time of one distillation step with whole logits vs recipes/distill.py's chunked KD loss.

    python benchmarks/distill_loss_memory.py                  # CPU: tiny Llamas with Llama-3's 128,256-token vocabulary
    python benchmarks/distill_loss_memory.py --device cuda    # GPU: peak allocated CUDA memory instead of peak RSS

A student (hidden size --hidden) and a teacher twice as wide, one micro-batch of --rows x --tokens tokens, loss
`(1 - kd_ratio) x CE + kd_ratio x forward KL` at kd_ratio 0.5, temperature 2. Each mode runs in a fresh process (peak
RSS is a per-process high-water mark):

- no_logits: the teacher's and the student's final hidden states only (their sums as the loss; the output layers
  still get a gradient and optimizer state): the floor every mode shares;
- full_logits: both models' logits for the whole micro-batch in fp32, then CE and KD (what most trainers do);
- chunked: `fsdp_recipes.methods.distill.distillation.DistillationLoss`, --chunk tokens at a time.

The memory attributable to the loss is a mode's peak minus no_logits' peak. Step time: the median of 3 steps after one
warm-up step, in the same process.
"""

from __future__ import annotations

import json

import memory_harness  # benchmarks/, the script's own folder

MODES = ("no_logits", "full_logits", "chunked")


def child(mode: str, args) -> dict:
    import torch
    import torch.nn.functional as F
    from transformers import AutoModelForCausalLM, LlamaConfig

    from fsdp_recipes.data.rows import IGNORE_INDEX
    from fsdp_recipes.methods.distill import distillation

    torch.manual_seed(0)
    device = torch.device(args.device)

    def llama(hidden: int):
        config = LlamaConfig(
            vocab_size=args.vocab,
            hidden_size=hidden,
            intermediate_size=2 * hidden,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            max_position_embeddings=args.tokens,
            tie_word_embeddings=False,
        )
        return AutoModelForCausalLM.from_config(config, attn_implementation="sdpa").to(device)

    student, teacher_model = llama(args.hidden), llama(2 * args.hidden).eval().requires_grad_(False)
    teacher = distillation.TeacherHidden(teacher_model)
    teacher.gather_head()
    loss = distillation.DistillationLoss(
        student, teacher, kd_ratio=0.5, temperature=2.0, kd_loss="forward_kl", chunk_size=args.chunk
    )
    optimizer = torch.optim.AdamW(student.parameters(), lr=1e-4)
    ids = torch.randint(0, args.vocab, (args.rows, args.tokens), device=device)
    positions = torch.arange(args.tokens, device=device).repeat(args.rows, 1)
    targets = torch.roll(ids, -1, dims=1)
    targets[:, -1] = IGNORE_INDEX
    batch = {"input_ids": ids, "position_ids": positions, "targets": targets}

    def step():
        if mode == "chunked":
            value = loss.loss_sum(student, batch)
        else:
            teacher_hidden = teacher(batch)
            hidden = student.model(input_ids=ids, position_ids=positions, use_cache=False).last_hidden_state
            if mode == "no_logits":
                value = hidden.float().sum() + teacher_hidden.float().sum() + 0.0 * student.lm_head.weight.sum()
            else:
                logits = student.lm_head(hidden).float()
                with torch.no_grad():
                    teacher_logits = F.linear(teacher_hidden, teacher.weight).float()
                ce = F.cross_entropy(
                    logits.flatten(0, 1), targets.flatten(), ignore_index=IGNORE_INDEX, reduction="sum"
                )
                kd = distillation.kd_token_losses(logits, teacher_logits, "forward_kl", 2.0)
                value = 0.5 * ce + 0.5 * (kd * (targets != IGNORE_INDEX)).sum()
        value.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    peak, step_s = memory_harness.peak_and_step_time(step, device)
    return {"mode": mode, "peak_bytes": peak, "step_s": step_s}


def main() -> None:
    args = memory_harness.parser(__doc__, rows=2).parse_args()
    if args.child:
        print(json.dumps(child(args.child, args)))
        return
    results = memory_harness.each_mode_in_a_fresh_process(__file__, MODES)
    base = results["no_logits"]["peak_bytes"]
    whole, chunked = results["full_logits"], results["chunked"]
    report = {
        "setup": f"{args.rows} x {args.tokens} tokens, vocabulary {args.vocab}, student hidden {args.hidden}, "
        f"teacher hidden {2 * args.hidden}, chunks of {args.chunk}, {args.device}",
        "peak_gib": {mode: round(r["peak_bytes"] / 2**30, 3) for mode, r in results.items()},
        "loss_share_gib": {
            "full_logits": round((whole["peak_bytes"] - base) / 2**30, 3),
            "chunked": round((chunked["peak_bytes"] - base) / 2**30, 3),
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


if __name__ == "__main__":
    main()
