"""The REST routes of ``tinker.RestClient`` (docs/tinker-protocol.md, section 14): training
runs, their checkpoints (list, delete, TTL), a checkpoint's weights info, sessions. A caller
sees its own runs and sessions only; anything else is 404.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from fastapi import APIRouter

from grpoflow.tinker.errors import ApiError
from grpoflow.tinker.schemas import TtlBody, WeightsInfoBody

if TYPE_CHECKING:
    from grpoflow.tinker.service import TinkerService

__all__ = ["rest_routes"]


def _run_json(service: TinkerService, meta: dict[str, Any]) -> dict[str, Any]:
    """A ``TrainingRun``: the run's description, its newest checkpoints, its last request."""
    run = meta["training_run_id"]
    ckpts = service.store.checkpoints(run)
    last = {kind: next((c for c in reversed(ckpts) if c["checkpoint_type"] == kind), None)
            for kind in ("training", "sampler")}
    live = service.registry.models.get(run)
    when = live.last_request if live else (ckpts[-1]["time"] if ckpts else meta["created"])
    return {"training_run_id": run, "base_model": meta["base_model"],
            "model_owner": meta["model_owner"], "is_lora": True, "corrupted": False,
            "lora_rank": meta.get("lora_rank"), "last_request_time": when,
            "last_checkpoint": last["training"], "last_sampler_checkpoint": last["sampler"],
            "user_metadata": meta.get("user_metadata") or None}


def rest_routes(r: APIRouter, service: TinkerService, auth: Any) -> None:  # noqa: ANN401
    """Add the REST routes to ``r`` (``auth``: the authenticating dependency, giving the
    caller's identity)."""

    def own_run(run_id: str, owner: str) -> dict[str, Any]:
        meta = service.store.read_run(run_id)
        if meta is None or meta.get("model_owner") != owner:
            raise ApiError(404, f"unknown training run {run_id!r}")
        return meta

    def page(items: list[Any], offset: int, limit: int) -> tuple[list[Any], dict[str, int]]:
        offset, limit = max(0, offset), max(0, limit)
        return items[offset:offset + limit], {"offset": offset, "limit": limit,
                                              "total_count": len(items)}

    @r.get("/training_runs")
    async def training_runs(owner: str = auth, limit: int = 20, offset: int = 0) -> dict[str, Any]:
        runs = [m for m in service.store.runs() if m.get("model_owner") == owner]
        runs.sort(key=lambda m: m.get("created", ""), reverse=True)
        chosen, cursor = page(runs, offset, limit)
        return {"training_runs": [_run_json(service, m) for m in chosen], "cursor": cursor}

    @r.get("/training_runs/{run_id}")
    async def training_run(run_id: str, owner: str = auth) -> dict[str, Any]:
        return _run_json(service, own_run(run_id, owner))

    @r.get("/training_runs/{run_id}/checkpoints")
    async def checkpoints(run_id: str, owner: str = auth) -> dict[str, Any]:
        own_run(run_id, owner)
        return {"checkpoints": service.store.checkpoints(run_id)}

    @r.delete("/training_runs/{run_id}/checkpoints/{kind}/{name}")
    async def delete_checkpoint(run_id: str, kind: str, name: str, owner: str = auth,
                                ) -> dict[str, Any]:
        own_run(run_id, owner)
        if kind not in ("weights", "sampler_weights") or not service.store.delete(
                run_id, kind, name):
            raise ApiError(404, f"no checkpoint tinker://{run_id}/{kind}/{name}")
        return {}

    @r.put("/training_runs/{run_id}/checkpoints/{kind}/{name}/ttl")
    async def set_ttl(run_id: str, kind: str, name: str, body: TtlBody,
                      owner: str = auth) -> dict[str, Any]:
        own_run(run_id, owner)
        if kind not in ("weights", "sampler_weights") or not service.store.set_ttl(
                run_id, kind, name, body.ttl_seconds):
            raise ApiError(404, f"no checkpoint tinker://{run_id}/{kind}/{name}")
        return {}

    @r.get("/checkpoints")
    async def user_checkpoints(owner: str = auth, limit: int = 100, offset: int = 0,
                               ) -> dict[str, Any]:
        mine = [c for m in service.store.runs() if m.get("model_owner") == owner
                for c in service.store.checkpoints(m["training_run_id"])]
        mine.sort(key=lambda c: c["time"], reverse=True)
        chosen, cursor = page(mine, offset, limit)
        return {"checkpoints": chosen, "cursor": cursor}

    @r.post("/weights_info")
    async def weights_info(body: WeightsInfoBody, owner: str = auth) -> dict[str, Any]:
        run, kind, name, meta = service.readable_checkpoint(body.tinker_path, owner)
        lora = meta.get("lora_config") or {}
        return {"base_model": meta["base_model"], "optimizer_config": {"type": "adamw"},
                "is_lora": True, "lora_rank": meta.get("lora_rank"),
                **{k: bool(lora[k]) for k in ("train_unembed", "train_mlp", "train_attn")
                   if k in lora}}

    @r.get("/sessions")
    async def sessions(owner: str = auth, limit: int = 20, offset: int = 0) -> dict[str, Any]:
        with service.registry.lock:
            mine = [s.id for s in service.registry.sessions.values() if s.owner == owner]
        return {"sessions": page(mine[::-1], offset, limit)[0]}

    @r.get("/sessions/{session_id}")
    async def session(session_id: str, owner: str = auth) -> dict[str, Any]:
        with service.registry.lock:
            s = service.registry.sessions.get(session_id)
            if s is None or s.owner != owner:
                raise ApiError(404, f"unknown session {session_id!r}")
            return {"training_run_ids": list(s.model_ids), "sampler_ids": list(s.sampler_ids),
                    "user_metadata": {str(k): str(v) for k, v in s.user_metadata.items()}}
