"""Loaded by every Python process of a test's vLLM server (this folder is on its PYTHONPATH).

1. Loopback only. vLLM's ZMQ KV-event publisher binds only when its endpoint's host is `*`
   (`tcp://*:PORT` listens on every interface); with `tcp://127.0.0.1:PORT` it connects instead.
   Here `vllm.distributed.kv_events.ZmqEventPublisher._is_bind_endpoint` also accepts `tcp://127.0.0.1:...`, so the
   publisher and its replay socket bind on loopback only.
2. No orphans. When KVROUTE_TEST_PARENT_PID is set, a daemon thread checks every second that this
   process is alive and, once it is gone (the test binary exited, however it ended), kills this
   process's whole process group (the server was started as a group leader, and its engine-core
   children are in the same group).
"""

import os
import sys
import threading


def _watch(parent):
    import signal
    import time

    while True:
        time.sleep(1.0)
        try:
            os.kill(parent, 0)
        except ProcessLookupError:
            try:
                os.killpg(os.getpgrp(), signal.SIGKILL)
            finally:
                os._exit(1)
        except PermissionError:
            pass


_parent = os.environ.get("KVROUTE_TEST_PARENT_PID")
if _parent and _parent.isdigit():
    threading.Thread(target=_watch, args=(int(_parent),), daemon=True, name="kvroute-watchdog").start()


def _patch(module):
    cls = getattr(module, "ZmqEventPublisher", None)
    original = getattr(cls, "_is_bind_endpoint", None)
    if original is None or getattr(original, "_kvroute", False):
        return

    def _is_bind_endpoint(endpoint):
        if isinstance(endpoint, str) and endpoint.startswith("tcp://127.0.0.1:"):
            return True
        return original(endpoint)

    _is_bind_endpoint._kvroute = True
    cls._is_bind_endpoint = staticmethod(_is_bind_endpoint)


class _Finder:
    """Patches vllm.distributed.kv_events right after it is executed."""

    name = "vllm.distributed.kv_events"

    def find_spec(self, fullname, path=None, target=None):
        if fullname != self.name:
            return None
        for finder in sys.meta_path:
            if finder is self or not hasattr(finder, "find_spec"):
                continue
            spec = finder.find_spec(fullname, path, target)
            if spec is not None and spec.loader is not None:
                loader = spec.loader
                exec_module = loader.exec_module

                def patched(module, _exec=exec_module):
                    _exec(module)
                    _patch(module)

                loader.exec_module = patched
                return spec
        return None


sys.meta_path.insert(0, _Finder())
