"""The trainer engine pauses vLLM around the commit: the sender's
send_weights stages the version (start, update), then pauses the server,
commits (finish) and resumes it, also when the commit fails; a refused update
is neither paused nor committed.

The trainer side is real (a refit source over a module, a refit-coordinator).
The server side is a stand-in for vLLM's AsyncLLM that records what it is
asked, behind each of the two clients vLLM 0.33 ships:
- HTTPVLLMWeightSyncClient: an HTTP server on 127.0.0.1 that answers as
  vLLM's RL routes do (200, or 500 where the test makes a route fail);
- RayVLLMWeightSyncClient: Ray actors (a real local Ray cluster of one CPU)
  with AsyncLLM's method names and its keyword-only pause mode, raising
  where the test makes a call fail.
vLLM's own clients make the calls.
"""

from __future__ import annotations

import os

os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")
os.environ.setdefault("HUMMING_DISABLE_PARALLEL_BUILD", "1")

import threading  # noqa: E402
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer  # noqa: E402

import pytest  # noqa: E402

torch = pytest.importorskip("torch")
pytest.importorskip("vllm")

from conftest import network  # noqa: E402


class Routes(ThreadingHTTPServer):
    def __init__(self, failing=()):
        super().__init__(("127.0.0.1", 0), Handler)
        self.calls: list[str] = []
        self.failing = set(failing)
        threading.Thread(target=self.serve_forever, daemon=True).start()

    @property
    def url(self):
        return f"http://127.0.0.1:{self.server_address[1]}"


class Handler(BaseHTTPRequestHandler):
    def do_POST(self):  # noqa: N802 (http.server's name)
        length = int(self.headers.get("Content-Length") or 0)
        self.rfile.read(length)
        route = self.path.lstrip("/")
        self.server.calls.append(route)
        status = 500 if route.split("?")[0] in self.server.failing else 200
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.end_headers()
        self.wfile.write(b"{}")

    def log_message(self, *args):
        pass


def trainer(coordinator, routes, client=None, **info):
    from vllm.distributed.weight_transfer.base import ModuleSource
    from vllm.distributed.weight_transfer.clients import HTTPVLLMWeightSyncClient

    from refit.vllm import RefitTrainerInitInfo, RefitTrainerWeightTransferEngine, register
    register()
    module = torch.nn.Linear(4, 4)
    init = RefitTrainerInitInfo(rank=0, source_config={"coordinator": coordinator.config(), "network": network()},
                                drain_timeout_s=10.0, **info)
    if client is None:
        client = HTTPVLLMWeightSyncClient(routes.url, 10)
    return RefitTrainerWeightTransferEngine.trainer_init(init, client=client, source=ModuleSource(module))


def test_finish_is_paused_and_resumed(coordinator):
    routes = Routes()
    engine = trainer(coordinator, routes)
    try:
        engine.send_weights()
        engine.send_weights()
    finally:
        engine.shutdown()
        routes.shutdown()
    round_ = ["start_weight_update", "update_weights", "pause?mode=keep", "finish_weight_update", "resume"]
    assert routes.calls == ["init_weight_transfer_engine"] + round_ + round_, routes.calls


def test_a_failed_commit_still_resumes_and_pause_mode_is_passed(coordinator):
    routes = Routes(failing={"finish_weight_update"})
    engine = trainer(coordinator, routes, pause_mode="wait")
    try:
        with pytest.raises(Exception, match="500"):
            engine.send_weights()
    finally:
        engine.shutdown()
        routes.shutdown()
    assert routes.calls[1:] == ["start_weight_update", "update_weights", "pause?mode=wait", "finish_weight_update",
                                "resume"], routes.calls


def test_a_refused_update_is_not_paused_or_committed(coordinator):
    routes = Routes(failing={"update_weights"})
    engine = trainer(coordinator, routes)
    try:
        with pytest.raises(Exception, match="500"):
            engine.send_weights()
    finally:
        engine.shutdown()
        routes.shutdown()
    # finish only closes the round vLLM's workers already closed: no pause.
    assert routes.calls[1:] == ["start_weight_update", "update_weights", "finish_weight_update"], routes.calls


def test_an_unknown_pause_mode_is_refused_before_anything(coordinator):
    import refit
    routes = Routes()
    try:
        with pytest.raises(refit.InvalidArgumentError, match="pause_mode must be one of keep, wait, abort or None, "
                                                           "got 'later'"):
            trainer(coordinator, routes, pause_mode="later")
    finally:
        routes.shutdown()
    assert routes.calls == []


# ------------------------------------------------------------------ Ray


@pytest.fixture(scope="module")
def ray_cluster():
    ray = pytest.importorskip("ray")
    from ray import cloudpickle

    import async_llm_stand_in
    # The actor class travels by value: Ray's workers do not import the
    # tests, and its module imports nothing, so they start fast.
    cloudpickle.register_pickle_by_value(async_llm_stand_in)
    ray.init(num_cpus=1, include_dashboard=False, log_to_driver=False, configure_logging=False)
    try:
        yield ray
    finally:
        ray.shutdown()


def ray_servers(ray, n, failing=()):
    from async_llm_stand_in import AsyncLLMStandIn
    actor = ray.remote(num_cpus=0)(AsyncLLMStandIn)
    return [actor.remote(failing) for _ in range(n)]


def test_ray_actors_are_paused_and_resumed_around_each_commit(coordinator, ray_cluster):
    from vllm.distributed.weight_transfer.clients import RayVLLMWeightSyncClient
    servers = ray_servers(ray_cluster, 2)  # two data-parallel AsyncLLM actors
    engine = trainer(coordinator, None, client=RayVLLMWeightSyncClient(servers), pause_mode="wait")
    try:
        engine.send_weights()
        engine.send_weights()
    finally:
        engine.shutdown()
    round_ = ["start_weight_update", "update_weights", "pause?mode=wait", "finish_weight_update", "resume"]
    for calls in ray_cluster.get([s.recorded.remote() for s in servers], timeout=30):
        assert calls[:1 + 2 * len(round_)] == ["init_weight_transfer_engine"] + round_ + round_, calls


def test_ray_a_failed_commit_still_resumes_every_actor(coordinator, ray_cluster):
    from vllm.distributed.weight_transfer.clients import RayVLLMWeightSyncClient
    servers = ray_servers(ray_cluster, 2, failing={"finish_weight_update"})
    engine = trainer(coordinator, None, client=RayVLLMWeightSyncClient(servers))
    try:
        with pytest.raises(Exception, match="finish_weight_update failed"):
            engine.send_weights()
    finally:
        engine.shutdown()
    for calls in ray_cluster.get([s.recorded.remote() for s in servers], timeout=30):
        assert calls[1:6] == ["start_weight_update", "update_weights", "pause?mode=keep", "finish_weight_update",
                              "resume"], calls
