"""Import what tests/test_sglang_backend_gpu.py imports, with its sgl_kernel stand-in, and print the
full traceback of the first failure (one device call per import problem otherwise)."""
import importlib.util
import sys
import traceback

sys.path.insert(0, "tests")
spec = importlib.util.spec_from_file_location("sgl_gpu_test", "tests/test_sglang_backend_gpu.py")
mod = importlib.util.module_from_spec(spec)
spec.loader.exec_module(mod)
mod._stub_if_missing("sgl_kernel", "datasets")
try:
    for name in ["sglang.srt.layers.attention.triton_backend", "sglang.srt.layers.radix_attention",
                 "sglang.srt.model_executor.forward_batch_info", "sglang.srt.speculative.eagle_info",
                 "sglang.test.layer_ut_utils", "sglang.srt.configs.model_config",
                 "sglang.srt.mem_cache.kv_index_translator", "mlagen.sglang_plugin.backend"]:
        importlib.import_module(name)
        print("ok", name)
except Exception:  # noqa: BLE001
    traceback.print_exc(limit=-12)
