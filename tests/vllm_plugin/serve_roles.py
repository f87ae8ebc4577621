"""vLLM's two serving roles in two processes, as `vllm serve` runs them: this process is the API
server (it loads the plugins first, then starts the engine core and serves /metrics from
`get_prometheus_registry()`), a child forked from it is the engine core (vLLM's default start
method; `EngineCore.__init__` over the offline executor, requests stepped through its scheduler).
Before that, vLLM's plugin loader runs once under a faked other version. Prints one JSON line.
"""

import json
import logging
import os
import sys
import tempfile

GIB = 2**30


def _key(name, labels) -> str:
    return name + "{" + ",".join(f"{k}={labels[k]}" for k in sorted(labels)) + "}"


def _engine_core(queue, done) -> None:
    """The child: vLLM's engine core loads the plugins itself, then serves a few requests."""
    import vllm.plugins
    from vllm.v1.core.sched.scheduler import Scheduler

    from kvatlas.integrations.vllm import offline as kv
    from kvatlas.integrations.vllm import plugin as vllm_plugin
    from kvatlas.integrations.foreign import samples
    from kvatlas.integrations.vllm.ledger import snapshot
    eng = kv.build_engine("deepseek-v4-flash", 2 * GIB, max_model_len=4096, max_num_seqs=4,
                          max_num_batched_tokens=1024)
    loaded = vllm.plugins.plugins_loaded and vllm_plugin._P.registered and \
        getattr(Scheduler.make_stats, "__kvatlas_hook__", None) is vllm_plugin._on_stats
    eng.add_request("a", [9] * 3000, max_tokens=4)
    eng.add_request("b", [8] * 700, max_tokens=50)
    for _ in range(6):
        eng.step()
    tracker = vllm_plugin.trackers()[0]
    rows = samples(snapshot(tracker.layout, tracker.last))
    queue.put({"loaded": bool(loaded), "pid": os.getpid(),
               "samples": {_key(n, dict(zip(ln, lv))): v for n, ln, lv, v in rows}})
    done.wait(300)


def _scrape() -> dict:
    from prometheus_client import generate_latest
    from prometheus_client.parser import text_string_to_metric_families
    from vllm.v1.metrics.prometheus import get_prometheus_registry
    text = generate_latest(get_prometheus_registry()).decode()
    return {_key(s.name, s.labels): s.value for fam in text_string_to_metric_families(text)
            for s in fam.samples if s.name.startswith("kvatlas_")}


def serve(refused: dict) -> dict:
    import multiprocessing as mp
    from importlib.metadata import entry_points

    import vllm.plugins
    vllm.plugins.load_general_plugins()      # the API server loads plugins before it starts the engine
    (ep,) = [e for e in entry_points(group="vllm.general_plugins") if e.name == "kvatlas"]
    ctx = mp.get_context("fork")
    queue, done = ctx.Queue(), ctx.Event()
    child = ctx.Process(target=_engine_core, args=(queue, done))
    child.start()
    try:
        got = queue.get(timeout=400)
        one = _scrape()                           # one API server: the default registry
        os.environ["PROMETHEUS_MULTIPROC_DIR"] = tempfile.mkdtemp()
        several = _scrape()                       # several: a multiprocess registry per scrape
        del os.environ["PROMETHEUS_MULTIPROC_DIR"]
    finally:
        done.set()
        child.join(60)
    return {"entry_point": ep.value, "loaded_by_vllm": got["loaded"], "engine_core_samples": got["samples"],
            "one_api_server": one, "several_api_servers": several, "after_exit": len(_scrape()),
            "other_version": refused}


def fake_version(version: str) -> dict:
    """vLLM's loader with another vLLM release's distribution record first on the path (what
    importlib.metadata, and so the plugin, then reports as the installed vLLM): the plugin must log
    one line and change nothing. The record and the loader's once-per-process flag are removed
    afterwards, as a fresh process would have them."""
    import vllm.plugins
    from vllm.v1.core.sched.scheduler import Scheduler

    from kvatlas.integrations.vllm import plugin as vllm_plugin
    root = tempfile.mkdtemp()
    dist = os.path.join(root, f"vllm-{version}.dist-info")
    os.mkdir(dist)
    with open(os.path.join(dist, "METADATA"), "w") as f:
        f.write(f"Metadata-Version: 2.1\nName: vllm\nVersion: {version}\n")
    lines = []
    handler = logging.Handler()
    handler.emit = lambda record: lines.append(record.getMessage())
    logger = logging.getLogger("vllm.plugins.kvatlas")
    logger.addHandler(handler)
    sys.path.insert(0, root)
    try:
        vllm.plugins.load_general_plugins()
        return {"registered": vllm_plugin._P.registered, "lines": lines,
                "hooked": hasattr(Scheduler.make_stats, "__kvatlas_hook__"), "metrics_dir": bool(vllm_plugin._P.metrics_dir)}
    finally:
        sys.path.remove(root)
        logger.removeHandler(handler)
        vllm.plugins.plugins_loaded = False


if __name__ == "__main__":
    print(json.dumps(serve(fake_version(sys.argv[1] if len(sys.argv) > 1 else "0.35.0"))))
