"""The Tinker-compatible service (grpoflow.tinker) driven by the REAL Tinker SDK (tinker 0.38.0)
on the REAL compute, rl_core.tinker.backend.LoraBackend: sessions, LoRA training clients, the
SL loop, forward, forward_backward_custom, checkpoints and resumption, sampling and prompt
log-probs, two users at once, REST, the end of a session, and the refusals (a bad API key, an
unknown base model). Plus the wire pieces on their own: protobuf round trips through the SDK's
own codecs, seq_id ordering, the long-poll.

The server (fixture ``server``, module-scoped) serves one base model, a tiny random Qwen2
saved by tests/engine_helpers.py's ``save_tiny_model`` (tests/conftest.py's ``tiny_qwen2``
with a tokenizer of one character per token, so ``SEQ`` = ids 10..17 is the text
"6789abcd"): peft LoRA adapters, Tinker's losses, sampling and scoring through the embedded
engine, one torch thread. :class:`Instrumented` is that LoraBackend with test hooks only: it
records each call ``(model_id, op)``, can sleep ``delay`` before a training call (so that a
request outlives the long-poll: deterministic fault injection) and takes a lock around each
call so that a test can call the backend directly without racing the service's worker.

References: the same backend driven directly (a fresh model of the same seed and rank through
the same loop gives the same log-probs and the same adapter after the step: the issue's "the
outputs match the same loop written directly against grpoflow's trainer"; sampling with the
same adapter and seed); an independent peft forward over a saved checkpoint (2-D targets); a
plain transformers forward (the bare base model's prompt log-probs); the trainer's log-probs
against the engine's (a sampler's prompt log-probs, its samples' log-probs).
"""

from __future__ import annotations

import asyncio
import math
import threading
import time
from pathlib import Path

import numpy as np
import pytest
import tinker  # the dev extra installs it: a missing one fails, not skips
import torch
from conftest import EOS_ID  # noqa: E402
from engine_helpers import save_tiny_model  # noqa: E402

from grpoflow.tinker.app import create_app  # noqa: E402
from rl_core.engine.server import ServerThread  # noqa: E402
from rl_core.tinker import AdamParams, Datum, SampledSequence  # noqa: E402
from rl_core.tinker import SamplingParams as Params  # noqa: E402
from rl_core.tinker.backend import LoraBackend  # noqa: E402

BASE = "grpoflow/tiny-qwen2"
ALICE, BOB = "tml-alice-key", "tml-bob-key"
SEQ = [10, 11, 12, 13, 14, 15, 16, 17]  # "6789abcd"
pytestmark = [
    pytest.mark.timeout(300),
    # peft, when a model deletes its active adapter (the service's session cleanup, and the
    # direct reference models here) it activates another; harmless, as every backend call
    # activates its own adapter first
    pytest.mark.filterwarnings("ignore:Adapter .* was active which is now deleted"),
    pytest.mark.filterwarnings("ignore:`is_gradient_checkpointing` is deprecated"),
]


# ----------------------------------------------------------------------------- the backend
class Instrumented(LoraBackend):
    """The real LoraBackend, instrumented (see the module docstring): ``calls`` records
    ``(model_id, op)`` in execution order, ``delay`` seconds pass before each
    forward/forward_backward, and ``lock`` is held for each call."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.lock = threading.RLock()
        self.delay = 0.0
        self.calls: list[tuple[str, str]] = []

    def _call(self, model_id: str | None, op: str, fn, *args, **kwargs):
        with self.lock:
            if model_id is not None:
                self.calls.append((model_id, op))
            return fn(*args, **kwargs)

    def create_model(self, model_id, *args, **kwargs):
        return self._call(model_id, "create_model", super().create_model, model_id, *args,
                          **kwargs)

    def delete_model(self, model_id):
        return self._call(model_id, "delete_model", super().delete_model, model_id)

    def forward_backward(self, model_id, data, loss_fn, config=None, forward_only=False):
        time.sleep(self.delay)
        return self._call(model_id, "forward" if forward_only else "forward_backward",
                          super().forward_backward, model_id, data, loss_fn, config,
                          forward_only)

    def optim_step(self, model_id, params):
        return self._call(model_id, "optim_step", super().optim_step, model_id, params)

    def save_state(self, model_id, out_dir, with_optimizer=True):
        return self._call(model_id, "save_state", super().save_state, model_id, out_dir,
                          with_optimizer)

    def load_state(self, model_id, src_dir, with_optimizer):
        return self._call(model_id, "load_state", super().load_state, model_id, src_dir,
                          with_optimizer)

    def save_sampler_weights(self, model_id, out_dir):
        return self._call(model_id, "save_sampler_weights", super().save_sampler_weights,
                          model_id, out_dir)

    def adapter_weights(self, model_id):
        return self._call(None, "", super().adapter_weights, model_id)

    def sample(self, *args, **kwargs):
        return self._call(None, "", super().sample, *args, **kwargs)

    def compute_logprobs(self, *args, **kwargs):
        return self._call(None, "", super().compute_logprobs, *args, **kwargs)


class Recorder:
    """A metrics tracker (grpoflow.tinker.backend.MetricsTracker) that keeps what it gets."""

    def __init__(self) -> None:
        self.logged: list[tuple[str, int, dict]] = []

    def log_metrics(self, run_id, step, metrics):
        self.logged.append((run_id, step, dict(metrics)))


# ----------------------------------------------------------------------------- fixtures
@pytest.fixture(scope="module")
def torch_one_thread():
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory, torch_one_thread) -> Path:
    return save_tiny_model(tmp_path_factory.mktemp("tinker-model") / "tiny", seed=0)


@pytest.fixture(scope="module")
def server(tmp_path_factory, model_dir):
    """The service on :class:`Instrumented` (the real LoraBackend over the tiny Qwen2), keys
    for alice and bob; a 1 s long-poll so that slow requests go through try_again."""
    backend = Instrumented({BASE: model_dir}, num_threads=1)
    root = tmp_path_factory.mktemp("tinker-root")
    tracker = Recorder()
    app = create_app(backend, root=root, api_keys={ALICE, BOB}, poll_timeout_s=1.0,
                     tracker=tracker)
    thread = ServerThread(app).start()
    yield {"url": thread.url, "backend": backend, "root": root, "app": app, "tracker": tracker,
           "model_dir": model_dir}
    app.state.tinker.close()
    thread.stop()
    backend.close()


@pytest.fixture
def alice(server):
    with tinker.ServiceClient(base_url=server["url"], api_key=ALICE) as sc:
        yield sc


def ce_datum(tokens: list[int]) -> tinker.Datum:
    """Next-token cross-entropy on ``tokens``: input tokens[:-1], targets tokens[1:]."""
    return tinker.Datum(model_input=tinker.ModelInput.from_ints(tokens[:-1]),
                        loss_fn_inputs={"target_tokens": tokens[1:],
                                        "weights": [1.0] * (len(tokens) - 1)})


def direct_datum(tokens: list[int]) -> Datum:
    """:func:`ce_datum` as the backend takes it directly."""
    return Datum(tokens[:-1], {"target_tokens": np.array(tokens[1:], np.int64),
                               "weights": np.ones(len(tokens) - 1, np.float32)})


def train(tc, data, steps: int, lr: float) -> list[float]:
    """``steps`` of forward_backward(cross_entropy) + optim_step; the losses. Each step's
    optim_step is awaited: a test that then reads the adapter from the backend directly must
    not race the service's worker (under load it read the weights before the step once)."""
    losses = []
    for _ in range(steps):
        fb = tc.forward_backward(data, "cross_entropy")
        opt = tc.optim_step(tinker.AdamParams(learning_rate=lr))
        losses.append(fb.result().metrics["loss:sum"])
        opt.result()
    return losses


def hf_logprobs(model_dir: Path, tokens: list[int], adapter_dir: Path | None = None
                ) -> torch.Tensor:
    """log_softmax of a plain transformers (+ peft ``adapter_dir``) forward over ``tokens``:
    [len(tokens), vocab], row i the distribution of the token after tokens[i]."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    if adapter_dir is not None:
        from peft import PeftModel

        model = PeftModel.from_pretrained(model, str(adapter_dir)).eval()
    with torch.no_grad():
        logits = model(input_ids=torch.tensor([tokens])).logits[0]
    return torch.log_softmax(logits.float(), -1)


# ----------------------------------------------------------------------------- SDK tests
def test_capabilities_and_tokenizer(server, alice):
    with pytest.warns(FutureWarning):  # deprecated in the SDK, still served
        caps = alice.get_server_capabilities()
    assert [m.model_name for m in caps.supported_models] == [BASE]
    tc = alice.create_lora_training_client(base_model=BASE, rank=4).result()
    info = tc.get_info()
    assert info.model_data.model_name == BASE and info.lora_rank == 4
    assert tc.model_id.endswith(":train:0")
    assert (tc.model_id, "create_model") in server["backend"].calls
    tok = tc.get_tokenizer()  # get_info's tokenizer_id: the model's local directory
    assert tok.encode("6789abcd", add_special_tokens=False) == SEQ
    assert tok.decode(SEQ) == "6789abcd" and tok.eos_token_id == EOS_ID


def test_sl_loop_loss_falls_forward_and_ordering(server, alice, caplog):
    backend = server["backend"]
    caplog.set_level("WARNING", logger="tinker")
    tc = alice.create_lora_training_client(base_model=BASE, rank=4, seed=1).result()
    data = [ce_datum(SEQ), ce_datum(SEQ[2:] + [3, 4])]
    before = tc.forward(data, "cross_entropy").result()
    assert [o["logprobs"].shape for o in before.loss_fn_outputs] == [[7], [7]]
    losses = []
    backend.delay = 1.5  # longer than the 1 s long-poll: the SDK gets try_again and re-polls
    try:
        for _ in range(6):  # both submitted before either result is read: seq order holds
            fb = tc.forward_backward(data, "cross_entropy")
            opt = tc.optim_step(tinker.AdamParams(learning_rate=1e-2))
            losses.append(fb.result().metrics["loss:sum"])
            assert "grad_norm:mean" in opt.result().metrics
            backend.delay = 0.0
    finally:
        backend.delay = 0.0
    assert losses[0] == pytest.approx(before.metrics["loss:sum"], rel=1e-5)
    assert losses[-1] < 0.25 * losses[0], losses
    assert "because of try_again" in caplog.text  # the 1.5 s request outlived a long-poll
    mine = [(step, m) for run, step, m in server["tracker"].logged if run == tc.model_id]
    assert [step for step, _ in mine] == [0, 1, 1, 2, 2, 3, 3, 4, 4, 5, 5, 6]
    assert mine[0][1]["loss:sum"] == losses[0] and mine[0][1]["tokens:sum"] == 14
    assert "grad_norm:mean" in mine[1][1]
    ops = [op for mid, op in backend.calls if mid == tc.model_id]
    assert ops[:14] == ["create_model", "forward"] + ["forward_backward", "optim_step"] * 6
    after = tc.forward(data, "cross_entropy").result()
    assert after.metrics["loss:sum"] < losses[-1]
    again = tc.forward(data, "cross_entropy").result()  # forward changes nothing
    assert again.metrics["loss:sum"] == after.metrics["loss:sum"]


def test_sdk_loop_matches_the_trainer_directly(server, alice):
    """The acceptance check: forward_backward(cross_entropy) + optim_step through the SDK
    give the log-probs and the adapter update of the same loop run directly on the backend
    (a fresh model id of the same seed and rank)."""
    backend = server["backend"]
    adam = {"learning_rate": 1e-2, "beta1": 0.9, "beta2": 0.99, "eps": 1e-8,
            "weight_decay": 0.01, "grad_clip_norm": 5.0}
    seqs = [SEQ, SEQ[2:] + [3, 4], [20, 21, 22, 23, EOS_ID]]
    tc = alice.create_lora_training_client(base_model=BASE, rank=4, seed=11).result()
    fb = tc.forward_backward([ce_datum(s) for s in seqs], "cross_entropy")
    opt = tc.optim_step(tinker.AdamParams(**adam))
    sdk_fb, sdk_opt = fb.result(), opt.result()
    sdk_after = tc.forward([ce_datum(s) for s in seqs], "cross_entropy").result()

    direct = f"direct-{tc.model_id}"
    backend.create_model(direct, BASE, 4, seed=11)
    try:
        initial = backend.adapter_weights(direct)
        outs, metrics = backend.forward_backward(direct, [direct_datum(s) for s in seqs],
                                                 "cross_entropy")
        step = backend.optim_step(direct, AdamParams(**adam))
        after, after_metrics = backend.forward_backward(
            direct, [direct_datum(s) for s in seqs], "cross_entropy", forward_only=True)
        want, got = backend.adapter_weights(direct), backend.adapter_weights(tc.model_id)
    finally:
        backend.delete_model(direct)
    for sdk, ref in ((sdk_fb, outs), (sdk_after, after)):
        assert len(sdk.loss_fn_outputs) == len(ref) == 3
        for out, lp in zip(sdk.loss_fn_outputs, ref, strict=True):
            np.testing.assert_allclose(out["logprobs"].to_numpy(), lp, rtol=0, atol=1e-6)
    assert sdk_fb.metrics["loss:sum"] == pytest.approx(metrics["loss:sum"], rel=1e-6)
    assert sdk_after.metrics["loss:sum"] == pytest.approx(after_metrics["loss:sum"], rel=1e-6)
    assert sdk_opt.metrics["grad_norm:mean"] == pytest.approx(step["grad_norm:mean"], rel=1e-6)
    assert sorted(got) == sorted(want)
    for name, w in want.items():
        torch.testing.assert_close(got[name], w, rtol=0, atol=1e-6, msg=name)
    assert all(not torch.equal(initial[k], want[k]) for k in want if ".lora_B." in k)
    assert after_metrics["loss:sum"] < metrics["loss:sum"]


def test_2d_sparse_targets_and_custom_loss(server, alice):
    tc = alice.create_lora_training_client(base_model=BASE, rank=2, seed=3).result()

    def custom(data, logprobs):  # the SDK's client-side loss: -2 * sum(logprobs)
        loss = sum(-2.0 * lp.sum() for lp in logprobs)
        return loss, {"custom:mean": float(loss.detach())}

    plain = [ce_datum(SEQ)]
    ce = tc.forward(plain, "cross_entropy").result().metrics["loss:sum"]
    res = tc.forward_backward_custom(plain, custom).result()
    assert res.metrics["loss:sum"] == pytest.approx(2 * ce, rel=1e-4)
    # the surrogate: cross-entropy with weights -dC/dlogprobs = 2, so twice the plain loss
    assert res.metrics["surrogate_loss:sum"] == pytest.approx(2 * ce, rel=1e-4)
    tc.optim_step(tinker.AdamParams(learning_rate=1e-2)).result()
    assert tc.forward(plain, "cross_entropy").result().metrics["loss:sum"] < 0.9 * ce
    path = tc.save_state("two-d").result().path  # B != 0 now: the adapter matters

    tokens = [10, 11, 12, 13, 14, 15]  # [N, K] targets, mostly 0: the SDK sends them CSR
    targets = torch.zeros(6, 16, dtype=torch.long)
    targets[:, 0] = torch.tensor(tokens) + 1
    targets[2, 5] = 40
    weights = torch.zeros(6, 16)
    weights[:, 0] = 1.0
    datum = tinker.Datum(model_input=tinker.ModelInput.from_ints(tokens),
                         loss_fn_inputs={"target_tokens": targets, "weights": weights})
    assert datum.loss_fn_inputs["target_tokens"].sparse_crow_indices is not None
    out = tc.forward([datum, ce_datum(SEQ)], "cross_entropy").result()
    lp = out.loss_fn_outputs[0]["logprobs"]
    assert lp.shape == [6, 16] and out.loss_fn_outputs[1]["logprobs"].shape == [7]
    assert path.endswith("/weights/two-d")
    saved = server["root"] / tc.model_id / "weights" / "two-d"
    want = hf_logprobs(server["model_dir"], tokens, saved).gather(1, targets)  # plain peft
    np.testing.assert_allclose(lp.to_numpy(), want.numpy(), rtol=1e-5, atol=1e-5)
    second = out.loss_fn_outputs[1]["logprobs"].to_numpy()
    assert out.metrics["loss:sum"] == pytest.approx(-float(want[:, 0].sum()) - second.sum(),
                                                    rel=1e-5)


def test_checkpoints_resume_and_rest(server, alice):
    backend = server["backend"]
    tc = alice.create_lora_training_client(base_model=BASE, rank=4,
                                           user_metadata={"renderer_name": "role_colon"}
                                           ).result()
    data = [ce_datum(SEQ)]
    train(tc, data, 1, 1e-2)
    path = tc.save_state("step-1").result().path
    assert path == f"tinker://{tc.model_id}/weights/step-1"
    saved = server["root"] / tc.model_id / "weights" / "step-1"
    assert {"adapter_config.json", "adapter_model.safetensors", "tinker_state.json",
            "optimizer.pt"} <= {p.name for p in saved.iterdir()}
    saved_loss = tc.forward(data, "cross_entropy").result().metrics["loss:sum"]
    train(tc, data, 1, 1e-2)  # moves on after the save

    session = tc.model_id.split(":train:")[0]
    resumed = alice.create_training_client_from_state(path).result()
    with_opt = alice.create_training_client_from_state_with_optimizer(path).result()
    for client in (resumed, with_opt):
        assert client.model_id.startswith(f"{session}:train:")
        assert client.get_info().lora_rank == 4
        loss = client.forward(data, "cross_entropy").result().metrics["loss:sum"]
        assert loss == pytest.approx(saved_loss, rel=1e-5)
    assert len({tc.model_id, resumed.model_id, with_opt.model_id}) == 3
    train(with_opt, data, 1, 1e-2)  # the step tc took after the save, with the saved AdamW
    ours, theirs = backend.adapter_weights(with_opt.model_id), backend.adapter_weights(
        tc.model_id)
    for name, w in theirs.items():  # an exact resume: the same adapter as tc's
        torch.testing.assert_close(ours[name], w, rtol=0, atol=1e-6, msg=name)
    with pytest.warns(FutureWarning):  # the deprecated in-place load (model_id + seq_id)
        tc.load_state(path).result()
    assert tc.forward(data, "cross_entropy").result().metrics["loss:sum"] == pytest.approx(
        saved_loss, rel=1e-5)
    from_state = alice.create_sampling_client(model_path=path).result()  # weights/ sample too
    got = from_state.sample(tinker.ModelInput.from_ints([10]), 2, tinker.SamplingParams(
        max_tokens=3)).result().sequences
    assert len(got) == 2 and all(len(s.tokens) == len(s.logprobs) > 0 for s in got)

    rest = tinker.RestClient(base_url=server["url"], api_key=ALICE)
    run = rest.get_training_run(tc.model_id).result()
    assert run.base_model == BASE and run.lora_rank == 4
    assert run.user_metadata == {"renderer_name": "role_colon"}
    assert run.last_checkpoint.tinker_path == path
    assert rest.get_training_run_by_tinker_path(path).result().training_run_id == tc.model_id
    ckpts = rest.list_checkpoints(tc.model_id).result().checkpoints
    assert [(c.checkpoint_id, c.checkpoint_type) for c in ckpts] == [("weights/step-1",
                                                                       "training")]
    assert rest.get_weights_info_by_tinker_path(path).result().lora_rank == 4
    runs = rest.list_training_runs().result()
    assert tc.model_id in {r.training_run_id for r in runs.training_runs}
    assert set(rest.get_session(session).result().training_run_ids) >= {tc.model_id,
                                                                        resumed.model_id}

    with pytest.raises(tinker.RequestFailedError, match="exists") as exc:  # no overwrite
        tc.save_state("step-1").result()
    assert exc.value.category == tinker.types.RequestErrorCategory.User
    assert tc.save_state("step-1", overwrite=True).result().path == path
    with pytest.raises(tinker.NotFoundError):
        alice.create_training_client_from_state(f"tinker://{tc.model_id}/weights/nope").result()
    rest.delete_checkpoint_from_tinker_path(path).result()
    assert rest.list_checkpoints(tc.model_id).result().checkpoints == []


def test_sampling(server, alice):
    backend = server["backend"]
    tc = alice.create_lora_training_client(base_model=BASE, rank=4, seed=0).result()
    # enough for greedy decoding to continue SEQ, then end it with EOS
    train(tc, [ce_datum(SEQ + [EOS_ID])], 5, 2e-2)
    sampler = tc.save_weights_and_get_sampling_client().result()
    assert sampler.get_base_model() == BASE
    prompt = tinker.ModelInput.from_ints(SEQ[:2])
    params = tinker.SamplingParams(max_tokens=6, temperature=1.0, seed=7)
    resp = sampler.sample(prompt, num_samples=3, sampling_params=params).result()
    assert len(resp.sequences) == 3 and all(s.sequence_id for s in resp.sequences)
    adapters = list(server["root"].glob(f".ephemeral/{tc.model_id.split(':')[0]}:sample:*"))
    assert len(adapters) == 1  # the ephemeral sampler weights
    want = backend.sample(BASE, adapters[0], SEQ[:2], 3, Params(max_tokens=6, seed=7))
    for got, ref in zip(resp.sequences, want, strict=True):  # the backend, called directly
        assert got.tokens == ref.tokens and got.stop_reason == ref.stop_reason
        np.testing.assert_allclose(got.logprobs, ref.logprobs, rtol=1e-5, atol=1e-6)
    again = sampler.sample(prompt, num_samples=3, sampling_params=params).result()
    assert [s.tokens for s in again.sequences] == [s.tokens for s in resp.sequences]
    assert len({tuple(s.tokens) for s in resp.sequences}) > 1  # seed + i: different samples
    first = resp.sequences[0]  # its log-probs are the engine's scores of prompt + sample
    scored = sampler.compute_logprobs(tinker.ModelInput.from_ints(SEQ[:2] + first.tokens)
                                      ).result()
    np.testing.assert_allclose(first.logprobs, scored[2:], rtol=1e-4, atol=1e-4)

    greedy = sampler.sample(prompt, 1, tinker.SamplingParams(max_tokens=8, temperature=0)
                            ).result().sequences[0]
    assert greedy.tokens[:6] == SEQ[2:], greedy  # what it was trained on
    stop_tok = SEQ[4]
    by_id = sampler.sample(prompt, 1, tinker.SamplingParams(max_tokens=8, temperature=0,
                                                            stop=[stop_tok])).result()
    assert by_id.sequences[0].tokens == SEQ[2:5] and by_id.sequences[0].stop_reason == "stop"
    text = tc.get_tokenizer().decode([stop_tok])
    assert text == "a"
    by_str = sampler.sample(prompt, 1, tinker.SamplingParams(max_tokens=8, temperature=0,
                                                             stop=text)).result()
    assert by_str.sequences[0].tokens == SEQ[2:5] and by_str.sequences[0].stop_reason == "stop"
    empty = sampler.sample(prompt, 1, tinker.SamplingParams(max_tokens=8, temperature=0,
                                                            stop=[])).result().sequences[0]
    # the SDK's stop=[]: no stop at all, EOS included: greedy goes on to max_tokens
    assert greedy.stop_reason == "stop" and len(greedy.tokens) < 8, greedy  # at EOS
    assert (len(empty.tokens), empty.stop_reason) == (8, "length"), empty
    assert empty.tokens[:6] == SEQ[2:]

    lps = sampler.compute_logprobs(tinker.ModelInput.from_ints(SEQ)).result()
    assert lps[0] is None and len(lps) == len(SEQ)
    trainer = tc.forward([ce_datum(SEQ)], "cross_entropy").result()  # the trainer's view
    np.testing.assert_allclose(lps[1:], trainer.loss_fn_outputs[0]["logprobs"].to_numpy(),
                               rtol=1e-4, atol=1e-4)
    assert sum(lps[1:]) == pytest.approx(-trainer.metrics["loss:sum"], rel=1e-4)

    named = tc.save_weights_for_sampler("s-1").result().path
    assert named == f"tinker://{tc.model_id}/sampler_weights/s-1"
    from_path = alice.create_sampling_client(model_path=named).result()
    assert from_path.get_base_model() == BASE  # via GET samplers/{id}
    assert from_path.sample(prompt, 2, params).result().sequences[0].tokens == first.tokens
    base_only = alice.create_sampling_client(base_model=BASE).result()
    base_lps = base_only.compute_logprobs(tinker.ModelInput.from_ints(SEQ)).result()
    plain = hf_logprobs(server["model_dir"], SEQ)[:-1].gather(1, torch.tensor(SEQ[1:])[:, None])
    np.testing.assert_allclose(base_lps[1:], plain[:, 0].numpy(), rtol=1e-4, atol=1e-4)
    assert sum(base_lps[1:]) < sum(lps[1:]) - 5  # the trained adapter was in use above


def test_two_users_at_once(server):
    results: dict[str, object] = {}

    def train_as(key: str) -> None:
        try:
            with tinker.ServiceClient(base_url=server["url"], api_key=key) as sc:
                tc = sc.create_lora_training_client(base_model=BASE, rank=2).result()
                losses = train(tc, [ce_datum(SEQ)], 3, 2e-2)
                path = tc.save_state("mine").result().path
                results[key] = (tc.model_id, losses, path)
        except BaseException as exc:  # noqa: BLE001 - reported below
            results[key] = exc

    threads = [threading.Thread(target=train_as, args=(k,)) for k in (ALICE, BOB)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    (a_id, a_losses, a_path), (b_id, b_losses, _) = results[ALICE], results[BOB]
    assert a_id.split(":")[0] != b_id.split(":")[0]  # two sessions
    assert a_losses[-1] < 0.7 * a_losses[0] and b_losses[-1] < 0.7 * b_losses[0]
    with tinker.ServiceClient(base_url=server["url"], api_key=BOB) as bob:
        with pytest.raises(tinker.NotFoundError):  # alice's run is not bob's
            tinker.RestClient(base_url=server["url"], api_key=BOB).get_training_run(a_id).result()
        with pytest.raises(tinker.NotFoundError):
            bob.create_sampling_client(model_path=a_path).result()


def test_session_end_releases_models(server):
    backend, root = server["backend"], server["root"]
    with tinker.ServiceClient(base_url=server["url"], api_key=BOB) as sc:
        tc = sc.create_lora_training_client(base_model=BASE, rank=2).result()
        resumed = sc.create_training_client_from_state(tc.save_state("kept").result().path
                                                       ).result()
        tc.save_weights_and_get_sampling_client().result()
        session = tc.model_id.split(":train:")[0]
        mine = {tc.model_id, resumed.model_id}
        assert mine <= set(backend.model_ids())
        assert list(root.glob(f".ephemeral/{session}:sample:*"))
    deadline = time.monotonic() + 30  # the session finished: its models leave the backend
    while mine & set(backend.model_ids()) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not mine & set(backend.model_ids())
    assert [(m, "delete_model") in backend.calls for m in sorted(mine)] == [True, True]
    assert not list(root.glob(f".ephemeral/{session}:sample:*"))
    assert (root / tc.model_id / "weights" / "kept" / "tinker_state.json").is_file()  # stays


def test_gspo_through_the_sdk(server, alice):
    """forward_backward(gspo) from the real SDK: each datum's sequence ratio (here 1.1 on the
    masked positions, set through the sampler log-probs) clipped by loss_fn_config's bounds."""
    tc = alice.create_lora_training_client(base_model=BASE, rank=4, seed=0).result()
    [lp] = [o["logprobs"].to_numpy() for o in
            tc.forward([ce_datum(SEQ)], "cross_entropy").result().loss_fn_outputs]
    n = len(SEQ) - 1
    mask = np.array([0.0] * 2 + [1.0] * (n - 2), np.float32)
    adv = mask * np.linspace(0.5, 1.5, n, dtype=np.float32)
    q = (lp - mask * math.log(1.1)).astype(np.float32)  # mask 0: q = logp, ratio 1, no signal
    datum = tinker.Datum(model_input=tinker.ModelInput.from_ints(SEQ[:-1]),
                         loss_fn_inputs={"target_tokens": SEQ[1:], "logprobs": q.tolist(),
                                         "advantages": adv.tolist(),
                                         "sequence_ratio_mask": mask.tolist()})
    out = tc.forward_backward([datum], "gspo").result()
    assert out.metrics["loss:sum"] == pytest.approx(-1.1 * adv.sum(), rel=1e-4)
    assert out.metrics["ratio:mean"] == pytest.approx(1.1, rel=1e-4)
    assert out.metrics["clipped_frac:mean"] == 0.0 and out.metrics["tokens:sum"] == n - 2
    np.testing.assert_allclose(out.loss_fn_outputs[0]["logprobs"].to_numpy(), lp, atol=1e-5)
    tight = tc.forward_backward([datum], "gspo", {"clip_low_threshold": 0.95,
                                                  "clip_high_threshold": 1.05}).result()
    assert tight.metrics["loss:sum"] == pytest.approx(-1.05 * adv.sum(), rel=1e-4)
    assert tight.metrics["clipped_frac:mean"] == 1.0
    no_mask = tinker.Datum(model_input=datum.model_input, loss_fn_inputs={
        k: v for k, v in datum.loss_fn_inputs.items() if k != "sequence_ratio_mask"})
    with pytest.raises(tinker.RequestFailedError, match="sequence_ratio_mask"):
        tc.forward_backward([no_mask], "gspo").result()


def test_bad_key_and_unknown_base_model(server, alice):
    with (tinker.ServiceClient(base_url=server["url"], api_key="tml-not-a-key") as sc,
          pytest.raises(tinker.AuthenticationError)):
        sc.create_lora_training_client(base_model=BASE).result()
    with pytest.raises(tinker.BadRequestError, match=f"unknown base model.*{BASE}"):
        alice.create_lora_training_client(base_model="Qwen/Qwen3-4B").result()
    tc = alice.create_lora_training_client(base_model=BASE, rank=2).result()
    with pytest.raises(tinker.RequestFailedError, match="not supported") as exc:
        tc.forward_backward([ce_datum(SEQ)], "stable_reinforce").result()
    assert exc.value.category == tinker.types.RequestErrorCategory.User
    bad = tinker.Datum(model_input=tinker.ModelInput.from_ints([1, 2, 3]),
                       loss_fn_inputs={"target_tokens": [1, 2], "weights": [1.0, 1.0]})
    with pytest.raises(tinker.RequestFailedError, match="one row per input token") as exc:
        tc.forward([bad], "cross_entropy").result()  # the backend's TinkerError
    assert exc.value.category == tinker.types.RequestErrorCategory.User
    huge = tinker.Datum(model_input=tinker.ModelInput.from_ints([10, 11]),
                        loss_fn_inputs={"target_tokens": [11, 64], "weights": [1.0, 1.0]})
    with pytest.raises(tinker.RequestFailedError, match="outside"):  # past the vocabulary
        tc.forward([huge], "cross_entropy").result()
    assert tc.forward([ce_datum(SEQ)], "cross_entropy").result().metrics["loss:sum"] > 0


# ----------------------------------------------------------------------------- wire pieces
def test_protobuf_round_trips_through_the_sdk_codecs():
    import zstandard
    from tinker.proto.request_conv import forward_backward_request_to_proto
    from tinker.proto.response_conv import (
        deserialize_forward_backward_output,
        deserialize_sample_response,
    )
    from tinker.types import ForwardBackwardInput, ForwardBackwardRequest

    from grpoflow.tinker.proto import (
        decode_forward_backward,
        encode_forward_backward_output,
        encode_sample_response,
    )

    dense = tinker.Datum(model_input=tinker.ModelInput.from_ints([5, 6, 7]),
                         loss_fn_inputs={"target_tokens": [6, 7, 8],
                                         "logprobs": [-1.0, -2.0, -0.5],
                                         "advantages": [0.0, 1.5, -1.5]})
    targets = torch.zeros(3, 20, dtype=torch.long)
    targets[1, 4] = 9
    sparse = tinker.Datum(model_input=tinker.ModelInput.from_ints([1, 2, 3]),
                          loss_fn_inputs={"target_tokens": targets})
    req = ForwardBackwardRequest(
        ForwardBackwardInput([dense, sparse], "ppo", {"clip_low_threshold": 0.8, "tag": "x"}),
        model_id="s-1:train:0", seq_id=3)
    body = forward_backward_request_to_proto(req).SerializeToString()
    got = decode_forward_backward(zstandard.ZstdCompressor().compress(body), "zstd")
    assert (got.model_id, got.seq_id, got.loss_fn, got.forward_only) == ("s-1:train:0", 3,
                                                                         "ppo", False)
    assert got.config == {"clip_low_threshold": pytest.approx(0.8), "tag": "x"}
    assert got.data_error is None and got.data[0].tokens == [5, 6, 7]
    assert got.data[0].inputs["target_tokens"].dtype == np.int64
    np.testing.assert_array_equal(got.data[0].inputs["advantages"], [0.0, 1.5, -1.5])
    assert got.data[0].inputs["advantages"].dtype == np.float32
    np.testing.assert_array_equal(got.data[1].inputs["target_tokens"], targets.numpy())

    outs = [np.array([-1.0, -2.0], np.float32), np.zeros((2, 3), np.float32) - 0.5,
            np.array([-0.25], np.float32)]
    decoded = deserialize_forward_backward_output(encode_forward_backward_output(
        outs, {"loss:sum": 3.5, "no_reduction": 1.0, "a:b:c": 2.0}))
    assert [o["logprobs"].shape for o in decoded.loss_fn_outputs] == [[2], [2, 3], [1]]
    np.testing.assert_array_equal(decoded.loss_fn_outputs[1]["logprobs"].to_numpy(), outs[1])
    assert decoded.metrics == {"loss:sum": 3.5}  # keys the SDK cannot merge are dropped

    seqs = [SampledSequence([4, 5], [-0.1, -0.2], "stop"), SampledSequence([6], [-1.0], "length")]
    sample = deserialize_sample_response(encode_sample_response(seqs, [None, -1.0, -2.0]))
    assert [s.tokens for s in sample.sequences] == [[4, 5], [6]]
    assert [s.stop_reason for s in sample.sequences] == ["stop", "length"]
    assert sample.prompt_logprobs == [None, -1.0, -2.0]


def test_seq_order_idempotency_and_long_poll():
    from grpoflow.tinker.futures import FutureStore, Result, Scheduler

    store = FutureStore(retrieved_ttl_s=0.0)
    sched = Scheduler(["b"], store)
    ran: list[int] = []

    def job(i):
        return lambda: (ran.append(i), Result(json={"i": i}))[1]

    sched.open_order("m", "b")
    r3, r2 = sched.submit_ordered("m", 3, job(3)), sched.submit_ordered("m", 2, job(2))
    time.sleep(0.2)
    assert ran == [] and sched.held("m") == [2, 3]  # waiting for seq 1
    assert sched.submit_ordered("m", 2, job(99)) == r2  # a retried POST: the same request
    r1 = sched.submit_ordered("m", 1, job(1))

    async def results():
        return [await store.wait(r, 5.0) for r in (r1, r2, r3)]

    assert [r.json["i"] for r in asyncio.run(results())] == [1, 2, 3] and ran == [1, 2, 3]
    late = asyncio.run(store.wait(sched.submit_ordered("m", 1, job(7)), 5.0))
    assert late.json["i"] == 1  # seq 1 again is the first one's result, not a re-run

    gate = threading.Event()
    slow = sched.submit("b", lambda: (gate.wait(10), Result(json={"ok": True}))[1])

    async def poll_then_wake():
        started = time.monotonic()
        assert await store.wait(slow, 0.3) is None  # not ready: try_again after the bound
        assert time.monotonic() - started >= 0.25
        threading.Timer(0.2, gate.set).start()
        got = await store.wait(slow, 10.0)  # woken by the worker, not by the bound
        return got, time.monotonic() - started

    got, took = asyncio.run(poll_then_wake())
    assert got.json == {"ok": True} and took < 5.0
    time.sleep(0.01)
    store.sweep(force=True)  # retrieved results expire after retrieved_ttl_s
    with pytest.raises(KeyError):
        asyncio.run(store.wait(slow, 0.1))
    sched.close()



def test_http_surface_with_any_tml_key(tmp_path, model_dir):
    from fastapi.testclient import TestClient

    from grpoflow.tinker.app import CLIENT_CONFIG

    backend = LoraBackend({BASE: model_dir}, num_threads=1)  # loads the model on first use
    app = create_app(backend, root=tmp_path,  # api_keys None: any tml- key
                     session_ttl_s=0.4)
    with TestClient(app) as c:
        key = {"X-API-Key": "tml-anyone"}
        assert c.post("/api/v1/client/config", json={}, headers=key).json() == CLIENT_CONFIG
        for headers in ({"X-API-Key": "sk-nope"}, {}):
            r = c.post("/api/v1/client/config", json={}, headers=headers)
            assert r.status_code == 401 and r.json()["detail"]
        assert c.post("/api/v1/client/dynamic_config", json={}, headers=key).json() == {}
        assert c.get("/api/v1/no_such_route", headers=key).status_code == 404
        assert c.get("/api/v1/create_model", headers=key).status_code == 404  # not 405
        assert c.post("/api/v1/telemetry", json={"events": []}, headers=key).json() == {
            "status": "accepted"}
        sid = c.post("/api/v1/create_session", json={"tags": [], "sdk_version": "0.38.0",
                                                     "user_metadata": {}},
                     headers=key).json()["session_id"]
        beat = {"session_id": sid, "type": "session_heartbeat"}
        assert c.post("/api/v1/session_heartbeat", json=beat, headers=key).status_code == 200
        other = {"X-API-Key": "tml-someone-else"}
        assert c.post("/api/v1/session_heartbeat", json=beat, headers=other).status_code == 404
        assert c.post(f"/api/v1/sessions/{sid}/finish", json={"reason": {"type": "success"},
                                                               "detail": None},
                      headers=key).status_code == 200
        assert c.post("/api/v1/session_heartbeat", json=beat, headers=key).status_code == 410
        quiet = c.post("/api/v1/create_session", json={"tags": [], "sdk_version": "0.38.0"},
                       headers=key).json()["session_id"]
        time.sleep(1.0)  # no heartbeat for longer than session_ttl_s: finished
        assert c.post("/api/v1/session_heartbeat", json={"session_id": quiet},
                      headers=key).status_code == 410
        r = c.post("/api/v1/retrieve_future", json={"request_id": "req-nope"}, headers=key)
        assert r.status_code == 404 and r.json()["detail"]
        r = c.post("/api/v1/forward_backward", content=b"\xff\x00garbage", headers={
            **key, "Content-Type": "application/x-protobuf"})
        assert r.status_code == 400 and r.json()["detail"]  # never an empty 400 (section 2)
        r = c.post("/api/v1/asample", json={"prompt": {"chunks": []},
                                            "sampling_session_id": "x:sample:0"}, headers=key)
        assert r.status_code == 404
        caps = c.get("/api/v1/get_server_capabilities", headers=key).json()
        assert caps == {"supported_models": [{"model_name": BASE, "trainable": True,
                                              "sampleable": True,
                                              "max_context_length": 256}]}
    assert backend.model_ids() == []  # nothing was created: the model was never loaded


def test_serve_config(tmp_path, monkeypatch, model_dir):
    from fastapi.testclient import TestClient

    from grpoflow.cli import main
    from grpoflow.tinker.serve import api_keys_of, build_app, load_serve_config, resolve_models
    from rl_core.config import ConfigError

    root = Path(__file__).resolve().parents[1]
    cfg = load_serve_config(root / "configs" / "tinker-tiny-cpu.yaml", ["port=8123"])
    assert cfg.port == 8123 and cfg.base_models == {"grpoflow/tiny": "embedded:tiny"}
    monkeypatch.setenv("GRPOFLOW_TINKER_API_KEYS", "tml-one-key, tml-two-key")
    assert api_keys_of(cfg) == {"tml-one-key", "tml-two-key"}
    monkeypatch.setenv("GRPOFLOW_TINKER_API_KEYS", "sk-wrong-kind")
    with pytest.raises(ConfigError, match="tml-"):
        api_keys_of(cfg)
    with pytest.raises(ConfigError, match="unknown key"):
        load_serve_config(None, ["prot=1"])
    missing = load_serve_config(None, [f"base_models={{m: {tmp_path}/absent}}"])
    with pytest.raises(ConfigError, match="absent"):
        resolve_models(missing)
    assert main(["serve-tinker", str(tmp_path / "nope.yaml")]) == 2  # a config error

    monkeypatch.delenv("GRPOFLOW_TINKER_API_KEYS")
    cfg = load_serve_config(None, [f"root={tmp_path}/runs", "api_keys=[tml-only-key]"])
    with TestClient(build_app(cfg, LoraBackend({BASE: model_dir}))) as c:
        assert c.get("/api/v1/get_server_capabilities",
                     headers={"X-API-Key": "tml-only-key"}).status_code == 200
        assert c.get("/api/v1/get_server_capabilities",
                     headers={"X-API-Key": "tml-other-key"}).status_code == 401
    assert (tmp_path / "runs").is_dir()
