"""Keyed sampling: each completion's tokens drawn from softmax(logits / temperature), within top-k and top-p, by the
Gumbel-max trick with noise that is a pure function of (seed, the completion's key, the token's index in the
completion, the vocabulary entry). No random generator state is involved, so a completion's tokens depend on
nothing else in its batch: not on its neighbours, the number of ranks, how a generation engine schedules requests,
or the device (the noise is integer hashing, the same on a CPU and a GPU). Every generation backend
(`train.generation`) applies the same `keyed_scores`, so the backends agree token for token.

`KeyedSampling` is the logits processor for transformers' `generate` (plain or static-cache compiled);
`PagedKeyedSampling` the one for its continuous-batching engine (per-request arguments)."""

from __future__ import annotations

import torch

_MASK32 = 0xFFFFFFFF


def _mix32(value):
    """A 32-bit integer finaliser (xor-shift-multiply), on a Python int or an int64 tensor whose values lie in
    [0, 2**32): multiplications may wrap the int64, and the mask keeps the low 32 bits, which wrapping leaves exact."""
    value = value ^ (value >> 16)
    value = (value * 0x7FEB352D) & _MASK32
    value = value ^ (value >> 15)
    value = (value * 0x846CA68B) & _MASK32
    return value ^ (value >> 16)


def row_seed(seed, key, step):
    """The 31-bit noise seed of one sampled token: `seed` (the run's), `key` (the completion's, < 2**63) and `step`
    (the token's index in the completion, from 0). Python ints or int64 tensors (broadcast), with equal results."""
    value = _mix32((seed & _MASK32) ^ 0x9E3779B9)
    value = _mix32(value ^ (key & _MASK32))
    value = _mix32(value ^ ((key >> 32) & _MASK32))
    return _mix32(value ^ (step & _MASK32)) >> 1  # 31 bits: the engine's int32 argument keeps a flag beside it


_COLUMN_HASHES: dict[tuple[int, str], torch.Tensor] = {}


def _column_hashes(vocab_size: int, device: torch.device) -> torch.Tensor:
    key = (vocab_size, str(device))
    if key not in _COLUMN_HASHES:
        _COLUMN_HASHES[key] = _mix32(torch.arange(vocab_size, device=device, dtype=torch.int64) + 0x632BE5AB)
    return _COLUMN_HASHES[key]


def gumbel_noise(seeds: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """Standard Gumbel noise, [rows, vocab_size] float32, from one seed (`row_seed`) per row (int64 tensor): one
    finaliser round over (the row's seed xor the entry's hash), both already well mixed."""
    bits = seeds.to(torch.int64).unsqueeze(1) ^ _column_hashes(vocab_size, seeds.device)
    bits ^= bits >> 16  # `_mix32` in place: a [rows, vocabulary] pass per operation, no temporaries kept
    bits.mul_(0x7FEB352D).bitwise_and_(_MASK32)
    bits ^= bits >> 15
    bits.mul_(0x846CA68B).bitwise_and_(_MASK32)
    bits ^= bits >> 16
    uniform = bits.bitwise_right_shift_(9).to(torch.float32)  # 23 bits: with the half below, exact in float32
    uniform.add_(0.5).div_(2**23)  # strictly inside (0, 1): 24 bits would round the largest up to 1.0
    return uniform.log_().neg_().log_().neg_()


def keyed_scores(
    scores: torch.Tensor, seeds: torch.Tensor, *, temperature: float, top_k: int | None, top_p: float
) -> torch.Tensor:
    """Scores whose argmax is a sample of softmax(scores / temperature) restricted to the top-k and the top-p nucleus
    (transformers' warpers), one row per seed."""
    from transformers import TopKLogitsWarper, TopPLogitsWarper

    scores = scores.float() / temperature
    if top_k:
        scores = TopKLogitsWarper(top_k)(None, scores)
    if top_p < 1.0:
        scores = TopPLogitsWarper(top_p)(None, scores)
    return scores + gumbel_noise(seeds, scores.shape[-1])


class KeyedSampling:
    """The logits processor for `generate` with `do_sample=False`: turns its argmax into keyed sampling. Rows are
    `keys` (one per prompt of the batch); the token index is the input width minus `prompt_width`. `not_first` (the
    tokens that end a completion, or None) cannot be the first token, as `min_new_tokens=1` would do, but here so that
    every backend applies it alike. `greedy`: no noise (plain argmax, still with that rule)."""

    def __init__(
        self,
        *,
        seed: int,
        keys: list[int],
        prompt_width: int,
        temperature: float = 1.0,
        top_k: int | None = None,
        top_p: float = 1.0,
        not_first: list[int] | None = None,
        greedy: bool = False,
    ):
        self.seed, self.keys, self.prompt_width = seed, torch.tensor(keys, dtype=torch.int64), prompt_width
        self.temperature, self.top_k, self.top_p = temperature, top_k, top_p
        self.not_first, self.greedy = not_first, greedy

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        step = input_ids.shape[1] - self.prompt_width
        if step == 0 and self.not_first:
            scores = scores.clone()
            scores[:, self.not_first] = -float("inf")
        if self.greedy:
            return scores
        if self.keys.device != scores.device:  # once per batch, not a copy per decoded token
            self.keys = self.keys.to(scores.device)
        seeds = row_seed(self.seed, self.keys, step)
        return keyed_scores(scores, seeds, temperature=self.temperature, top_k=self.top_k, top_p=self.top_p)


def paged_processor(
    *, seed: int, temperature: float, top_k: int | None, top_p: float, not_first: list[int] | None, greedy: bool
):
    """The continuous-batching engine's processor list holding one `PagedKeyedSampling` (transformers builds its list
    from the generation config's own warpers, which draw from one random stream; this one is keyed)."""
    from transformers import LogitsProcessorList
    from transformers.generation.continuous_batching.cb_logits_processors import (
        ContinuousBatchingLogitsProcessor,
        ContinuousBatchingLogitsProcessorList,
    )

    class PagedKeyedSampling(ContinuousBatchingLogitsProcessor):
        """`KeyedSampling` for the engine: a request carries its key (`sampling_key=`), and the engine asks for one
        int32 argument per row that predicts a token, which is that token's noise seed (`row_seed`) with the token's
        index from the request's position (past the prompt's true length, after a preemption's soft reset too)."""

        supported_kwargs = {"sampling_key": int}
        ignored_kwargs = ()

        def fill_defaults(self, int32_tensor: torch.Tensor) -> None:
            int32_tensor.fill_(0)

        def prepare_tensor_args(self, requests_with_new_token) -> torch.Tensor:
            arguments = []
            for request in requests_with_new_token:
                state = request.state
                step = state.position_offset - (state._true_initial_tokens or len(state.initial_tokens))
                key = state.logit_processor_kwargs.get("sampling_key", 0)
                packed = (row_seed(seed, key, step) << 1) | int(step == 0)  # the seed, and "first token"
                arguments.append(packed - 2**32 if packed >= 2**31 else packed)
            return torch.tensor(arguments, dtype=torch.int32)

        def __call__(self, scores: torch.Tensor, tensor_arg: torch.Tensor) -> torch.Tensor:
            packed = tensor_arg[: scores.shape[0]].to(torch.int64) & _MASK32
            if not_first:
                first = (packed & 1).bool()
                scores = scores.clone()
                scores[:, not_first] = torch.where(first.unsqueeze(1), -float("inf"), scores[:, not_first])
            if greedy:
                return scores
            return keyed_scores(scores, packed >> 1, temperature=temperature, top_k=top_k, top_p=top_p)

    processors = ContinuousBatchingLogitsProcessorList(LogitsProcessorList([PagedKeyedSampling()]))
    processors.tensors_required = 1  # one int32 argument row, which the engine sizes its buffers for
    return processors
