"""List every top-level module missing on this machine along SGLang's attention-backend import chain.

Missing modules are replaced by permissive stubs so the walk continues; prints each missing name
once (what to carry as wheels to the GPU machine)."""
import importlib
import sys
import types

TARGETS = ["sglang.srt.layers.attention.triton_backend", "sglang.srt.model_executor.forward_batch_info",
           "sglang.srt.speculative.eagle_info", "sglang.test.layer_ut_utils", "sglang.srt.configs.model_config",
           "sglang.srt.mem_cache.kv_index_translator", "sglang.srt.layers.radix_attention"]


class _Stub(types.ModuleType):
    __path__ = []  # a package, so submodule imports resolve to stubs too

    def __getattr__(self, name):
        if name.startswith("__"):
            raise AttributeError(name)
        return type(name, (), {"__init__": lambda self, *a, **k: None, "__call__": lambda self, *a, **k: None})


def _drop_sglang_modules() -> None:
    """Forget every sglang module imported so far: a target whose import failed part-way leaves half-initialized
    modules that would make the next target fail on them instead of on its own cause."""
    for m in [m for m in sys.modules if m == "sglang" or m.startswith("sglang.")]:
        del sys.modules[m]


missing = []
for target in TARGETS:
    _drop_sglang_modules()
    for _ in range(60):
        try:
            importlib.import_module(target)
            print("ok", target)
            break
        except ModuleNotFoundError as e:
            name = e.name or str(e)
            missing.append(name)
            parts = name.split(".")
            for i in range(1, len(parts) + 1):
                sys.modules.setdefault(".".join(parts[:i]), _Stub(".".join(parts[:i])))
            _drop_sglang_modules()
        except Exception as e:  # noqa: BLE001
            print("error", target, type(e).__name__, str(e)[:200])
            break
print("MISSING:", sorted(set(n.split(".")[0] for n in missing)))
