"""A run's side of a vLLM server (`fsdp-recipes vllm-serve`, docs/vllm.md): the checks before any weights load
(`VLLMServer.connect`, `serving_problems`), completions (`generate`: token ids in, token ids and the sampling
log-probabilities out) and weights loaded from a folder the run wrote (`load_weights`). HTTP only, standard library
only: the server lives in its own environment, on this machine or another.

Every completion is one seeded request stream: the seed of a completion is a function of the run's seed and the
completion's sampling key (`train.sampling`'s key: round, prompt, generation index), so it depends neither on its
batch neighbours nor on the rank split, and a resumed run asks for exactly what the stopped one did. The completions
of one prompt whose keys follow each other go as one request with `n` of them (vLLM seeds the i-th with seed + i)."""

from __future__ import annotations

import concurrent.futures
import dataclasses
import http.client
import json
import socket
import time
import urllib.error
import urllib.request

from fsdp_recipes.common.errors import UserError

DESCRIBE = "fsdp_recipes_describe"  # the worker extension's methods (train/vllm_worker.py)
CLAIM = "fsdp_recipes_claim"
LOAD_WEIGHTS = "fsdp_recipes_load_weights"
PROCESSED_LOGPROBS = "processed_logprobs"
SEED_SPACE = 2**62  # request seeds stay in int64, with room for n - 1 more
MAX_CONCURRENT_REQUESTS = 64  # the server batches what arrives together; more threads only add overhead here
_UNREACHABLE = (urllib.error.URLError, ConnectionError, http.client.HTTPException, socket.timeout, TimeoutError)


class ServerError(UserError):
    """The vLLM server is unreachable, refuses a request, or is not one a run can use: the message says which and
    what to do. Every rank that talks to it meets it (each sends its own requests)."""


def request_seed(run_seed: int, key: int) -> int:
    """The vLLM seed of the completion with sampling key `key`: consecutive keys give consecutive seeds (except where
    the seed space wraps), which is how vLLM seeds the `n` completions of one request."""
    return (run_seed * 2**40 + key) % SEED_SPACE


@dataclasses.dataclass
class ServerInfo:
    """What a server holds (`fsdp_recipes_describe` on its workers, `/v1/models`)."""

    url: str
    served_model: str
    architecture: str
    shape: dict
    dtype: str
    max_model_len: int
    logprobs_mode: str
    tensor_parallel_size: int
    data_parallel_size: int

    def describe(self) -> str:
        return (
            f"vLLM server at {self.url} (serving {self.served_model}: {self.architecture}, {self.dtype}, tensor "
            f"parallel {self.tensor_parallel_size}, data parallel {self.data_parallel_size}, {self.max_model_len} tokens)"
        )


def serving_problems(info: ServerInfo, model_config, *, model_name: str, max_length: int) -> list[str]:
    """Why the server cannot generate for a run of `model_config` with rows of `max_length` tokens (empty: it can)."""
    problems = []
    start_it = f"start it for this run's model: fsdp-recipes vllm-serve --model {model_name}"
    text_config = getattr(model_config, "get_text_config", lambda: model_config)()
    differing = [
        f"{key} {value} (the run's model: {getattr(text_config, key)})"
        for key, value in info.shape.items()
        if getattr(text_config, key, None) is not None and getattr(text_config, key) != value
    ]
    if differing:
        problems.append(f"the {info.describe()} serves another model: its {', '.join(differing)}; {start_it}")
    if info.max_model_len < max_length:
        problems.append(
            f"the vLLM server at {info.url} takes at most {info.max_model_len} tokens per request (its max_model_len), "
            f"and this run's rows are up to max_length {max_length} (prompt + completion): restart it with "
            f"--max-model-len {max_length}"
        )
    if info.logprobs_mode != PROCESSED_LOGPROBS:
        problems.append(
            f"the vLLM server at {info.url} reports {info.logprobs_mode or 'raw'} log-probabilities, and the run "
            f"compares the trainer's with the ones it sampled from ({PROCESSED_LOGPROBS}): {start_it}"
        )
    return problems


@dataclasses.dataclass
class Sampled:
    """vLLM's completions of a list of prompts, in prompt order: token ids (up to and including the stop token),
    whether each hit the length limit instead, and each token's log-probability as vLLM sampled it."""

    token_ids: list[list[int]]
    truncated: list[bool]
    log_probs: list[list[float]]


class VLLMServer:
    """A connection to one vLLM server (its base URL), made by `connect`."""

    def __init__(self, base_url: str, *, request_timeout: float, owner: str = ""):
        self.url = base_url.rstrip("/")
        self.request_timeout = request_timeout
        self.owner = owner  # the run whose weights this server holds (its output folder)
        self.info: ServerInfo | None = None

    @classmethod
    def connect(
        cls, base_url: str, *, wait: float, request_timeout: float, model_name: str, owner: str = ""
    ) -> VLLMServer:
        """The server at `base_url`, once it answers (waiting up to `wait` seconds, as TRL's vllm_server_timeout) and
        says what it serves; ServerError otherwise. `owner` names the run (its output folder): `claim` makes the
        server its own."""
        server = cls(base_url, request_timeout=request_timeout, owner=owner)
        deadline, reason = time.monotonic() + wait, ""
        while True:
            try:
                server._call("GET", "/health", timeout=min(10.0, max(wait, 1.0)))
                break
            except ServerError as error:
                reason = str(error)
            if time.monotonic() >= deadline:
                raise ServerError(
                    f"no vLLM server answers at {server.url} (waited {wait:g} s, vllm_server_timeout; {reason}): start "
                    f"one for the run's model, `fsdp-recipes vllm-serve --model {model_name}` (docs/vllm.md), or "
                    "point vllm_server_base_url (or vllm_server_host and vllm_server_port) at yours"
                )
            time.sleep(1.0)
        server.info = server._describe()
        try:  # one token: a server whose engine cannot run this model fails here, before any weights load
            server.generate([[0]], [0], seed=0, max_tokens=1, temperature=1.0, top_p=1.0, top_k=None,
                            stop_token_ids=[], min_tokens=0, greedy=True)  # fmt: skip
        except ServerError as error:
            raise ServerError(
                f"the vLLM server at {server.url} cannot generate ({error}); its own log says why (vLLM's CPU "
                "attention, for one, takes head sizes of 32 and more): restart it once that is fixed"
            ) from None
        return server

    def _describe(self) -> ServerInfo:
        models = self._call("GET", "/v1/models")["data"]
        described = self._rpc(DESCRIBE)[0]
        return ServerInfo(
            url=self.url, served_model=models[0]["id"], architecture=described["architecture"],
            shape=described["shape"], dtype=described["dtype"], max_model_len=int(described["max_model_len"]),
            logprobs_mode=described["logprobs_mode"], tensor_parallel_size=described["tensor_parallel_size"],
            data_parallel_size=described["data_parallel_size"],
        )  # fmt: skip

    def _rpc(self, method: str, *args) -> list:
        try:
            return self._call("POST", "/collective_rpc", {"method": method, "args": list(args)})["results"]
        except ServerError as error:
            if "404" in str(error) or "has no attribute" in str(error) or "not found" in str(error).lower():
                raise ServerError(
                    f"the vLLM server at {self.url} cannot load a run's weights ({error}): it needs "
                    "VLLM_SERVER_DEV_MODE=1 and this package's worker extension, which `fsdp-recipes vllm-serve` "
                    "starts it with: restart it that way"
                ) from None
            raise

    def claim(self) -> None:
        """From now on the server holds this run's policy: a push by another run that claimed it since is refused."""
        self._rpc(CLAIM, self.owner)

    def load_weights(self, folder: str) -> None:
        """The weights in `folder` (safetensors in checkpoint format, on a filesystem the server reads) loaded in
        place on every worker, and the prefix cache emptied: the next completions are the new weights'."""
        results = self._rpc(LOAD_WEIGHTS, str(folder), self.owner)
        refused = next((result for result in results if isinstance(result, dict) and result.get("refused")), None)
        if refused is not None:
            raise ServerError(
                f"the vLLM server at {self.url} now serves another run ({refused['owner']}), which pushed its own "
                f"weights there after this run ({self.owner}) started: one server holds one run's policy; give each "
                "run a server of its own (fsdp-recipes vllm-serve --port ...)"
            )
        self._call("POST", "/reset_prefix_cache", {})

    def generate(
        self,
        prompt_ids: list[list[int]],
        keys: list[int],
        *,
        seed: int,
        max_tokens: int,
        temperature: float,
        top_p: float,
        top_k: int | None,
        stop_token_ids: list[int],
        min_tokens: int,
        greedy: bool,
    ) -> Sampled:
        """One completion per prompt, `keys[i]` seeding prompt i's (see `request_seed`); requests sent together."""
        common = dict(
            model=self.info.served_model, max_tokens=max_tokens, logprobs=0, return_token_ids=True,
            stop_token_ids=stop_token_ids, min_tokens=min_tokens, repetition_penalty=1.0, presence_penalty=0.0,
            frequency_penalty=0.0, min_p=0.0, skip_special_tokens=False,
            temperature=0.0 if greedy else temperature, top_p=1.0 if greedy else top_p,
            top_k=0 if greedy or top_k is None else top_k,
        )  # fmt: skip  # every sampling value set: vLLM would otherwise take the model's generation_config ones
        runs = _request_runs(prompt_ids, [request_seed(seed, key) for key in keys], greedy=greedy)
        results: list = [None] * len(prompt_ids)
        workers = max(1, min(MAX_CONCURRENT_REQUESTS, len(runs)))
        with concurrent.futures.ThreadPoolExecutor(max_workers=workers) as pool:
            futures = {
                pool.submit(self._call, "POST", "/v1/completions", {**common, "prompt": prompt_ids[first], "n": count,
                                                                    "seed": first_seed}): (first, count)
                for first, count, first_seed in runs
            }  # fmt: skip
            for future in concurrent.futures.as_completed(futures):
                first, count = futures[future]
                choices = sorted(future.result()["choices"], key=lambda choice: choice["index"])
                for offset, choice in enumerate(choices[:count]):
                    results[first + offset] = choice
        token_ids = [list(choice["token_ids"]) for choice in results]
        return Sampled(
            token_ids=token_ids,
            truncated=[choice["finish_reason"] == "length" for choice in results],
            log_probs=[[float(value) for value in choice["logprobs"]["token_logprobs"]] for choice in results],
        )

    def _call(self, method: str, path: str, body: dict | None = None, *, timeout: float | None = None):
        data = None if body is None else json.dumps(body).encode()
        request = urllib.request.Request(
            self.url + path, data=data, method=method, headers={"Content-Type": "application/json"}
        )
        try:
            with urllib.request.urlopen(request, timeout=timeout or self.request_timeout) as response:
                raw = response.read()
        except urllib.error.HTTPError as error:
            detail = error.read().decode(errors="replace")[:500]
            raise ServerError(
                f"the vLLM server at {self.url} refused {method} {path}: HTTP {error.code}: {detail}"
            ) from None
        except _UNREACHABLE as error:
            reason = getattr(error, "reason", None) or error
            raise ServerError(
                f"the vLLM server at {self.url} did not answer {method} {path} ({reason}; requests wait up to "
                f"vllm_request_timeout, {timeout or self.request_timeout:g} s): is it still running? (start it with "
                "fsdp-recipes vllm-serve)"
            ) from None
        return json.loads(raw) if raw else None


def _request_runs(prompt_ids: list[list[int]], seeds: list[int], *, greedy: bool) -> list[tuple[int, int, int]]:
    """(first prompt, count, first seed) of each request: consecutive prompts that are the same tokens with
    consecutive seeds go as one request of `n` (greedy decoding: one each, since seeds do not matter there)."""
    runs: list[list[int]] = []
    for index, (prompt, seed) in enumerate(zip(prompt_ids, seeds)):
        last = runs[-1] if runs else None
        if (
            not greedy
            and last is not None
            and prompt_ids[last[0]] == prompt
            and seed == last[2] + last[1]
            and last[0] + last[1] == index
        ):
            last[1] += 1
        else:
            runs.append([index, 1, seed])
    return [tuple(run) for run in runs]
