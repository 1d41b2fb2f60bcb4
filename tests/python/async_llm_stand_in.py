"""A stand-in for vLLM's AsyncLLM as a Ray actor (test_vllm_pause.py): it
records the calls RayVLLMWeightSyncClient makes, by AsyncLLM's method names
and with its keyword-only pause mode. Kept free of imports so that Ray's
workers, which receive it by value, start fast."""

from __future__ import annotations


class AsyncLLMStandIn:
    """Records the calls a RayVLLMWeightSyncClient makes of an AsyncLLM
    actor, by AsyncLLM's names, in the HTTP routes' spelling (pause with its
    mode); a call named in `failing` raises."""

    def __init__(self, failing=()):
        self.calls: list[str] = []
        self.failing = set(failing)

    def _call(self, name: str) -> None:
        self.calls.append(name)
        if name.split("?")[0] in self.failing:
            raise RuntimeError(f"{name} failed")

    async def init_weight_transfer_engine(self, request):
        self._call("init_weight_transfer_engine")

    async def start_weight_update(self):
        self._call("start_weight_update")

    async def update_weights(self, request):
        self._call("update_weights")

    async def finish_weight_update(self):
        self._call("finish_weight_update")

    async def pause_generation(self, *, mode="abort", clear_cache=True):
        self._call(f"pause?mode={mode}")

    async def resume_generation(self):
        self._call("resume")

    async def shutdown_weight_transfer_engine(self):
        self._call("shutdown_weight_transfer_engine")

    def recorded(self):
        return self.calls
