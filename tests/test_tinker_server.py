"""The Tinker-compatible service (grpoflow.tinker) driven by the REAL Tinker SDK (tinker 0.38.0):
sessions, LoRA training clients, the SL loop, forward, forward_backward_custom, checkpoints and
resumption, sampling and prompt log-probs, two users at once, REST, and the refusals (a bad
API key, an unknown base model). Plus the wire pieces on their own: protobuf round trips
through the SDK's own codecs, seq_id ordering, the long-poll.

STAND-IN BACKEND: the server tests run on :class:`BigramBackend`, a small in-test
implementation of the backend interface (grpoflow.tinker.backend.Backend): a bigram "language
model" (base logits plus a rank-r LoRA product, AdamW in torch) over the 64-word vocabulary
of tests/conftest.py's tokenizer (the fixture ``server``, and ``test_http_surface...`` and
``test_serve_config``). Only ``test_real_lora_backend_through_the_sdk`` runs on the real
rl_core.tinker.backend.LoraBackend.
"""

from __future__ import annotations

import asyncio
import json
import threading
import time
from pathlib import Path

import numpy as np
import pytest
import torch

tinker = pytest.importorskip("tinker")

from conftest import EOS_ID, TINY_VOCAB, tiny_tokenizer, word  # noqa: E402

from grpoflow.tinker.app import create_app  # noqa: E402
from rl_core.engine.server import ServerThread  # noqa: E402
from rl_core.tinker import SampledSequence, TinkerError  # noqa: E402

BASE = "grpoflow/tiny-bigram"
ALICE, BOB = "tml-alice-key", "tml-bob-key"
pytestmark = pytest.mark.timeout(300)


# ----------------------------------------------------------------------------- stand-in
class BigramBackend:
    """The stand-in backend (see the module docstring): position i of a datum predicts
    ``target_tokens[i]`` from ``tokens[i]`` alone. Losses: cross_entropy (1-D or [N, K]
    targets) and importance_sampling."""

    def __init__(self, tok_dir: Path) -> None:
        gen = torch.Generator().manual_seed(0)
        self.base = torch.randn(TINY_VOCAB, TINY_VOCAB, generator=gen)
        self.tok_dir, self.models, self.delay = tok_dir, {}, 0.0
        self.calls: list[tuple[str, str]] = []  # (model_id, method), in execution order

    def base_model_names(self) -> list[str]:
        return [BASE]

    def tokenizer_dir(self, base_model: str) -> str:
        return str(self.tok_dir)

    def create_model(self, model_id, base_model, rank, *, seed=None, train_mlp=True,
                     train_attn=True, train_unembed=True):
        gen = torch.Generator().manual_seed(seed or 0)
        a = (torch.randn(TINY_VOCAB, rank, generator=gen) * 0.1).requires_grad_()
        b = torch.zeros(rank, TINY_VOCAB, requires_grad=True)
        self.models[model_id] = {"a": a, "b": b, "opt": torch.optim.AdamW([a, b]),
                                 "config": {"base_model": base_model, "rank": rank}}
        self.calls.append((model_id, "create_model"))
        return {"model_id": model_id}

    def _weights(self, a, b):
        return self.base + a @ b

    @staticmethod
    def _logprobs(w, tokens, targets):
        logp = torch.log_softmax(w[torch.tensor(tokens)], -1)
        targets = torch.as_tensor(targets).long()
        if targets.ndim == 1:
            return logp.gather(1, targets[:, None])[:, 0]
        return logp.gather(1, targets)

    def forward_backward(self, model_id, data, loss_fn, config, forward_only):
        time.sleep(self.delay)
        self.calls.append((model_id, "forward" if forward_only else "forward_backward"))
        m = self.models[model_id]
        if loss_fn not in ("cross_entropy", "importance_sampling"):
            raise TinkerError(f"the stand-in has no {loss_fn}")
        w = self._weights(m["a"], m["b"])
        total, outs = torch.zeros(()), []
        for d in data:
            tgt = d.inputs["target_tokens"]
            if tgt.shape[0] != len(d.tokens):
                raise TinkerError(f"target_tokens has {tgt.shape[0]} rows for {len(d.tokens)} "
                                  "tokens")
            lp = self._logprobs(w, d.tokens, tgt)
            if loss_fn == "cross_entropy":
                loss = -(lp * torch.as_tensor(d.inputs["weights"])).sum()
            else:
                ratio = torch.exp(lp - torch.as_tensor(d.inputs["logprobs"]))
                loss = -(ratio * torch.as_tensor(d.inputs["advantages"])).sum()
            total = total + loss
            outs.append(lp.detach().numpy().astype(np.float32))
        if not forward_only and data:
            total.backward()
        return outs, {"loss:sum": float(total.detach())}

    def optim_step(self, model_id, params):
        self.calls.append((model_id, "optim_step"))
        m = self.models[model_id]
        for group in m["opt"].param_groups:
            group.update(lr=params.learning_rate, betas=(params.beta1, params.beta2),
                         eps=params.eps, weight_decay=params.weight_decay)
        norm = torch.nn.utils.clip_grad_norm_([m["a"], m["b"]], params.grad_clip_norm or 1e9)
        m["opt"].step()
        m["opt"].zero_grad()
        return {"grad_norm:mean": float(norm)}

    def save_state(self, model_id, out_dir, with_optimizer=True):
        self.calls.append((model_id, "save_state"))
        m = self.models[model_id]
        torch.save({"a": m["a"].detach(), "b": m["b"].detach(),
                    "opt": m["opt"].state_dict() if with_optimizer else None},
                   Path(out_dir) / "state.pt")
        (Path(out_dir) / "config.json").write_text(json.dumps(m["config"]))

    def load_state(self, model_id, src_dir, with_optimizer):
        m, saved = self.models[model_id], torch.load(Path(src_dir) / "state.pt")
        with torch.no_grad():
            m["a"].copy_(saved["a"])
            m["b"].copy_(saved["b"])
        if with_optimizer and saved["opt"] is not None:
            m["opt"].load_state_dict(saved["opt"])

    def saved_config(self, src_dir):
        return json.loads((Path(src_dir) / "config.json").read_text())

    def save_sampler_weights(self, model_id, out_dir):
        self.calls.append((model_id, "save_sampler_weights"))
        m = self.models[model_id]
        torch.save({"a": m["a"].detach(), "b": m["b"].detach()}, Path(out_dir) / "adapter.pt")

    def _sampler_weights(self, adapter_dir):
        if adapter_dir is None:
            return self.base
        d = Path(adapter_dir)
        saved = torch.load(d / ("adapter.pt" if (d / "adapter.pt").exists() else "state.pt"))
        return self._weights(saved["a"], saved["b"])

    def sample(self, base_model, adapter_dir, prompt, num_samples, params):
        w = self._sampler_weights(adapter_dir).detach()
        gen = torch.Generator().manual_seed(params.seed if params.seed is not None else 1234)
        stop_ids = {s for s in params.stop if isinstance(s, int)} | {EOS_ID}
        stop_strs = [s for s in params.stop if isinstance(s, str)]
        out = []
        for _ in range(num_samples):
            toks, lps, reason, last = [], [], "length", prompt[-1]
            for _ in range(params.max_tokens):
                logp = torch.log_softmax(w[last] / max(params.temperature, 1e-6), -1)
                tok = (int(logp.argmax()) if params.temperature == 0 else
                       int(torch.multinomial(logp.exp(), 1, generator=gen)))
                toks.append(tok)
                lps.append(float(logp[tok]))
                last = tok
                text = " ".join(word(t) for t in toks)
                if tok in stop_ids or any(text.endswith(s) for s in stop_strs):
                    reason = "stop"
                    break
            out.append(SampledSequence(tokens=toks, logprobs=lps, stop_reason=reason))
        return out

    def compute_logprobs(self, base_model, adapter_dir, tokens):
        w = self._sampler_weights(adapter_dir).detach()
        lp = self._logprobs(w, tokens[:-1], tokens[1:]).tolist()
        return [None, *lp]

    def close(self):
        pass


class Recorder:
    """A metrics tracker (grpoflow.tinker.backend.MetricsTracker) that keeps what it gets."""

    def __init__(self) -> None:
        self.logged: list[tuple[str, int, dict]] = []

    def log_metrics(self, run_id, step, metrics):
        self.logged.append((run_id, step, dict(metrics)))


# ----------------------------------------------------------------------------- fixtures
@pytest.fixture(scope="module")
def tok_dir(tmp_path_factory) -> Path:
    d = tmp_path_factory.mktemp("tinker-tokenizer")
    tiny_tokenizer().save_pretrained(d)
    return d


@pytest.fixture(scope="module")
def server(tmp_path_factory, tok_dir):
    """The service on a stand-in backend (BigramBackend), keys for alice and bob; a 1 s
    long-poll so that slow requests go through try_again."""
    backend = BigramBackend(tok_dir)
    root = tmp_path_factory.mktemp("tinker-root")
    tracker = Recorder()
    app = create_app(backend, root=root, api_keys={ALICE, BOB}, poll_timeout_s=1.0,
                     tracker=tracker)
    thread = ServerThread(app).start()
    yield {"url": thread.url, "backend": backend, "root": root, "app": app, "tracker": tracker}
    app.state.tinker.close()
    thread.stop()


@pytest.fixture
def alice(server):
    with tinker.ServiceClient(base_url=server["url"], api_key=ALICE) as sc:
        yield sc


def ce_datum(tokens: list[int]) -> tinker.Datum:
    """Next-token cross-entropy on ``tokens``: input tokens[:-1], targets tokens[1:]."""
    return tinker.Datum(model_input=tinker.ModelInput.from_ints(tokens[:-1]),
                        loss_fn_inputs={"target_tokens": tokens[1:],
                                        "weights": [1.0] * (len(tokens) - 1)})


SEQ = [10, 11, 12, 13, 14, 15, 16, 17]


# ----------------------------------------------------------------------------- SDK tests
def test_capabilities_and_tokenizer(server, alice):
    with pytest.warns(FutureWarning):  # deprecated in the SDK, still served
        caps = alice.get_server_capabilities()
    assert [m.model_name for m in caps.supported_models] == [BASE]
    tc = alice.create_lora_training_client(base_model=BASE, rank=4).result()
    info = tc.get_info()
    assert info.model_data.model_name == BASE and info.lora_rank == 4
    assert tc.model_id.endswith(":train:0")
    tok = tc.get_tokenizer()  # get_info's tokenizer_id: the local directory
    assert tok.encode("a10 a11 a12", add_special_tokens=False) == [10, 11, 12]


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
            opt = tc.optim_step(tinker.AdamParams(learning_rate=0.2))
            losses.append(fb.result().metrics["loss:sum"])
            assert "grad_norm:mean" in opt.result().metrics
            backend.delay = 0.0
    finally:
        backend.delay = 0.0
    assert losses[0] == pytest.approx(before.metrics["loss:sum"], rel=1e-5)
    assert losses[-1] < 0.5 * losses[0], losses
    assert "because of try_again" in caplog.text  # the 1.5 s request outlived a long-poll
    mine = [(step, m) for run, step, m in server["tracker"].logged if run == tc.model_id]
    assert [step for step, _ in mine] == [0, 1, 1, 2, 2, 3, 3, 4, 4, 5, 5, 6]
    assert mine[0][1] == {"loss:sum": losses[0]} and "grad_norm:mean" in mine[1][1]
    ops = [op for mid, op in backend.calls if mid == tc.model_id]
    assert ops[:14] == ["create_model", "forward"] + ["forward_backward", "optim_step"] * 6
    after = tc.forward(data, "cross_entropy").result()
    assert after.metrics["loss:sum"] < losses[-1]
    again = tc.forward(data, "cross_entropy").result()  # forward changes nothing
    assert again.metrics["loss:sum"] == pytest.approx(after.metrics["loss:sum"])


def test_2d_sparse_targets_and_custom_loss(server, alice):
    backend = server["backend"]
    tc = alice.create_lora_training_client(base_model=BASE, rank=2).result()
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
    m = backend.models[tc.model_id]
    want = backend._logprobs(backend._weights(m["a"], m["b"]), tokens, targets)
    np.testing.assert_allclose(lp.to_numpy(), want.detach().numpy(), rtol=1e-5)

    def custom(data, logprobs):  # the SDK's client-side loss: -2 * sum(logprobs)
        loss = sum(-2.0 * lp.sum() for lp in logprobs)
        return loss, {"custom:mean": float(loss.detach())}

    plain = [ce_datum(SEQ)]
    ce = tc.forward(plain, "cross_entropy").result().metrics["loss:sum"]
    res = tc.forward_backward_custom(plain, custom).result()
    assert res.metrics["loss:sum"] == pytest.approx(2 * ce, rel=1e-4)
    # the surrogate: cross-entropy with weights -dC/dlogprobs = 2, so twice the plain loss
    assert res.metrics["surrogate_loss:sum"] == pytest.approx(2 * ce, rel=1e-4)
    tc.optim_step(tinker.AdamParams(learning_rate=0.1)).result()
    assert tc.forward(plain, "cross_entropy").result().metrics["loss:sum"] < ce


def test_checkpoints_resume_and_rest(server, alice):
    tc = alice.create_lora_training_client(base_model=BASE, rank=4,
                                           user_metadata={"renderer_name": "role_colon"}
                                           ).result()
    data = [ce_datum(SEQ)]
    tc.forward_backward(data, "cross_entropy")
    tc.optim_step(tinker.AdamParams(learning_rate=0.2)).result()
    path = tc.save_state("step-1").result().path
    assert path == f"tinker://{tc.model_id}/weights/step-1"
    assert (server["root"] / tc.model_id / "weights" / "step-1" / "state.pt").is_file()
    saved_loss = tc.forward(data, "cross_entropy").result().metrics["loss:sum"]
    tc.forward_backward(data, "cross_entropy")  # moves on after the save
    tc.optim_step(tinker.AdamParams(learning_rate=0.2)).result()

    session = tc.model_id.split(":train:")[0]
    resumed = alice.create_training_client_from_state(path).result()
    with_opt = alice.create_training_client_from_state_with_optimizer(path).result()
    for client in (resumed, with_opt):
        assert client.model_id.startswith(f"{session}:train:")
        assert client.get_info().lora_rank == 4
        loss = client.forward(data, "cross_entropy").result().metrics["loss:sum"]
        assert loss == pytest.approx(saved_loss, rel=1e-5)
    assert len({tc.model_id, resumed.model_id, with_opt.model_id}) == 3
    with_opt.forward_backward(data, "cross_entropy")
    with_opt.optim_step(tinker.AdamParams(learning_rate=0.2)).result()
    with pytest.warns(FutureWarning):  # the deprecated in-place load (model_id + seq_id)
        tc.load_state(path).result()
    assert tc.forward(data, "cross_entropy").result().metrics["loss:sum"] == pytest.approx(
        saved_loss, rel=1e-5)
    from_state = alice.create_sampling_client(model_path=path).result()  # weights/ sample too
    assert len(from_state.sample(tinker.ModelInput.from_ints([10]), 2, tinker.SamplingParams(
        max_tokens=3)).result().sequences) == 2

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
    tc = alice.create_lora_training_client(base_model=BASE, rank=4).result()
    tc.forward_backward([ce_datum(SEQ)], "cross_entropy")
    tc.optim_step(tinker.AdamParams(learning_rate=0.2)).result()
    sampler = tc.save_weights_and_get_sampling_client().result()
    assert sampler.get_base_model() == BASE
    prompt = tinker.ModelInput.from_ints([10, 11])
    params = tinker.SamplingParams(max_tokens=6, temperature=1.0, seed=7)
    resp = sampler.sample(prompt, num_samples=3, sampling_params=params).result()
    assert len(resp.sequences) == 3
    adapter = next(server["root"].glob(".ephemeral/*"))  # the ephemeral sampler weights
    from rl_core.tinker import SamplingParams as Params

    want = backend.sample(BASE, adapter, [10, 11], 3, Params(max_tokens=6, seed=7))
    for got, ref in zip(resp.sequences, want, strict=True):
        assert got.tokens == ref.tokens and got.stop_reason == ref.stop_reason
        np.testing.assert_allclose(got.logprobs, ref.logprobs, rtol=1e-5)
        assert got.sequence_id

    greedy = backend.sample(BASE, adapter, [10, 11], 1, Params(max_tokens=8, temperature=0))[0]
    assert len(greedy.tokens) >= 3, greedy
    stop_tok = greedy.tokens[2]
    first = greedy.tokens.index(stop_tok)
    by_id = sampler.sample(prompt, 1, tinker.SamplingParams(max_tokens=8, temperature=0,
                                                            stop=[stop_tok])).result()
    assert by_id.sequences[0].tokens == greedy.tokens[:first + 1]
    assert by_id.sequences[0].stop_reason == "stop"
    by_str = sampler.sample(prompt, 1, tinker.SamplingParams(
        max_tokens=8, temperature=0, stop=word(stop_tok))).result()
    assert by_str.sequences[0].tokens == greedy.tokens[:first + 1]

    lps = sampler.compute_logprobs(tinker.ModelInput.from_ints(SEQ)).result()
    assert lps[0] is None and len(lps) == len(SEQ)
    np.testing.assert_allclose(lps[1:], backend.compute_logprobs(BASE, adapter, SEQ)[1:],
                               rtol=1e-5)

    named = tc.save_weights_for_sampler("s-1").result().path
    assert named == f"tinker://{tc.model_id}/sampler_weights/s-1"
    from_path = alice.create_sampling_client(model_path=named).result()
    assert from_path.get_base_model() == BASE  # via GET samplers/{id}
    assert from_path.sample(prompt, 2, params).result().sequences[0].tokens == \
        resp.sequences[0].tokens
    base_only = alice.create_sampling_client(base_model=BASE).result()
    base_lps = base_only.compute_logprobs(tinker.ModelInput.from_ints(SEQ)).result()
    np.testing.assert_allclose(base_lps[1:], backend.compute_logprobs(BASE, None, SEQ)[1:],
                               rtol=1e-5)


def test_two_users_at_once(server):
    results: dict[str, object] = {}

    def train(key: str) -> None:
        try:
            with tinker.ServiceClient(base_url=server["url"], api_key=key) as sc:
                tc = sc.create_lora_training_client(base_model=BASE, rank=2).result()
                losses = []
                for _ in range(3):
                    fb = tc.forward_backward([ce_datum(SEQ)], "cross_entropy")
                    tc.optim_step(tinker.AdamParams(learning_rate=0.2))
                    losses.append(fb.result().metrics["loss:sum"])
                path = tc.save_state("mine").result().path
                results[key] = (tc.model_id, losses, path)
        except BaseException as exc:  # noqa: BLE001 - reported below
            results[key] = exc

    threads = [threading.Thread(target=train, args=(k,)) for k in (ALICE, BOB)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    (a_id, a_losses, a_path), (b_id, b_losses, _) = results[ALICE], results[BOB]
    assert a_id.split(":")[0] != b_id.split(":")[0]  # two sessions
    assert a_losses[-1] < a_losses[0] and b_losses[-1] < b_losses[0]
    with tinker.ServiceClient(base_url=server["url"], api_key=BOB) as bob:
        with pytest.raises(tinker.NotFoundError):  # alice's run is not bob's
            tinker.RestClient(base_url=server["url"], api_key=BOB).get_training_run(a_id).result()
        with pytest.raises(tinker.NotFoundError):
            bob.create_sampling_client(model_path=a_path).result()


def test_bad_key_and_unknown_base_model(server, alice):
    with (tinker.ServiceClient(base_url=server["url"], api_key="tml-not-a-key") as sc,
          pytest.raises(tinker.AuthenticationError)):
        sc.create_lora_training_client(base_model=BASE).result()
    with pytest.raises(tinker.BadRequestError, match=f"unknown base model.*{BASE}"):
        alice.create_lora_training_client(base_model="Qwen/Qwen3-4B").result()
    tc = alice.create_lora_training_client(base_model=BASE, rank=2).result()
    with pytest.raises(tinker.RequestFailedError, match="not supported") as exc:
        tc.forward_backward([ce_datum(SEQ)], "gspo").result()
    assert exc.value.category == tinker.types.RequestErrorCategory.User
    bad = tinker.Datum(model_input=tinker.ModelInput.from_ints([1, 2, 3]),
                       loss_fn_inputs={"target_tokens": [1, 2], "weights": [1.0, 1.0]})
    with pytest.raises(tinker.RequestFailedError, match="rows"):  # the backend's TinkerError
        tc.forward([bad], "cross_entropy").result()
    assert tc.forward([ce_datum(SEQ)], "cross_entropy").result().metrics["loss:sum"] > 0


def test_real_lora_backend_through_the_sdk(tmp_path, one_thread):
    """The same service on rl_core.tinker.backend.LoraBackend (no stand-in): a tiny random
    Qwen2 with its tokenizer (tests/engine_helpers.py), trained, saved, resumed and sampled."""
    backend_mod = pytest.importorskip("rl_core.tinker.backend")
    from engine_helpers import save_tiny_model

    backend = backend_mod.LoraBackend({"tiny": save_tiny_model(tmp_path / "m0")}, num_threads=1)
    app = create_app(backend, root=tmp_path / "root")
    thread = ServerThread(app).start()
    try:
        with tinker.ServiceClient(base_url=thread.url, api_key="tml-real") as sc:
            tc = sc.create_lora_training_client(base_model="tiny", rank=4, seed=0).result()
            assert tc.get_tokenizer().encode("abc", add_special_tokens=False) == [14, 15, 16]
            full = [5, 6, 7, 20, 21, 22, 23, EOS_ID]
            datum = tinker.Datum(model_input=tinker.ModelInput.from_ints(full[:-1]),
                                 loss_fn_inputs={"target_tokens": full[1:],
                                                 "weights": [0.0, 0.0] + [1.0] * 5})
            losses = []
            for _ in range(4):
                fb = tc.forward_backward([datum], "cross_entropy")
                tc.optim_step(tinker.AdamParams(learning_rate=1e-2, eps=1e-8))
                losses.append(fb.result().metrics["loss:sum"])
            assert losses[-1] < 0.5 * losses[0], losses
            loss = tc.forward([datum], "cross_entropy").result().metrics["loss:sum"]
            path = tc.save_state("s1").result().path
            resumed = sc.create_training_client_from_state_with_optimizer(path).result()
            assert resumed.forward([datum], "cross_entropy").result().metrics[
                "loss:sum"] == pytest.approx(loss, rel=1e-5)
            sampler = tc.save_weights_and_get_sampling_client().result()
            out = sampler.sample(tinker.ModelInput.from_ints([5, 6, 7]), 2,
                                 tinker.SamplingParams(max_tokens=4, seed=1)).result()
            assert [len(s.tokens) == len(s.logprobs) > 0 for s in out.sequences] == [True] * 2
            lps = sampler.compute_logprobs(tinker.ModelInput.from_ints(full)).result()
            assert lps[0] is None and sum(lps[3:]) == pytest.approx(-loss, rel=1e-3)
            assert sorted(backend.model_ids()) == sorted([tc.model_id, resumed.model_id])
        deadline = time.monotonic() + 30  # the session finished: its models leave the backend
        while backend.model_ids() and time.monotonic() < deadline:
            time.sleep(0.05)
        assert backend.model_ids() == []
        assert not any((tmp_path / "root" / ".ephemeral").iterdir())
        assert (tmp_path / "root" / tc.model_id / "weights" / "s1").is_dir()  # checkpoints stay
    finally:
        app.state.tinker.close()
        thread.stop()
        backend.close()


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


def test_http_surface_with_any_tml_key(tmp_path, tok_dir):
    from fastapi.testclient import TestClient

    from grpoflow.tinker.app import CLIENT_CONFIG

    app = create_app(BigramBackend(tok_dir), root=tmp_path,  # api_keys None: any tml- key
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
                                              "sampleable": True}]}


def test_serve_config(tmp_path, monkeypatch, tok_dir):
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
    with TestClient(build_app(cfg, BigramBackend(tok_dir))) as c:
        assert c.get("/api/v1/get_server_capabilities",
                     headers={"X-API-Key": "tml-only-key"}).status_code == 200
        assert c.get("/api/v1/get_server_capabilities",
                     headers={"X-API-Key": "tml-other-key"}).status_code == 401
    assert (tmp_path / "runs").is_dir()
