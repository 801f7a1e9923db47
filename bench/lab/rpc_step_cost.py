"""What one decode step costs over llama.cpp RPC: plain greedy decoding of one model (argmax on the device, as
localspec decodes), all local and with its layers on a `localspec rpc-server` on this machine, interleaved.

    python bench/lab/rpc_step_cost.py [MODEL.gguf] [--port 50953] [--reps 7] [--tokens 64] [--threads 1]

Without a model it uses the demo target. Prints tok/s (median, min, max) and ms per token for each side, and
whether both produced the same tokens (docs/performance.md).
"""

# llama_cpp before numpy (docs/architecture.md)
import llama_cpp  # noqa: F401, I001

import argparse
import statistics
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # run from a plain checkout

from localspec import rpc  # noqa: E402
from localspec.errors import LocalspecError  # noqa: E402
from localspec.llama import backend  # noqa: E402
from localspec.llama.model import LlamaModel  # noqa: E402
from localspec.models import demo  # noqa: E402


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("model", nargs="?", type=Path)
    ap.add_argument("--port", type=int, default=50953)
    ap.add_argument("--reps", type=int, default=7)
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--threads", type=int, default=1)
    args = ap.parse_args()
    path = args.model or demo.target_path()
    server = subprocess.Popen([sys.executable, "-c", "from localspec.cli.app import main; main()", "rpc-server",
                               "--port", str(args.port), "--threads", str(args.threads)],
                              stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    endpoint = f"127.0.0.1:{args.port}"
    try:
        for _ in range(100):
            try:
                rpc.hello(rpc.parse_endpoint(endpoint), timeout=2)
                break
            except LocalspecError:
                time.sleep(0.3)
        models = {
            "local": LlamaModel(path, n_ctx=512, devices=[], n_threads=args.threads, device_top_k=64),
            "rpc": LlamaModel(path, n_ctx=512, devices=backend.rpc_devices([endpoint]),
                                        n_threads=args.threads, device_top_k=64),
        }
        for model in models.values():
            model.use_device_sampler("greedy")
        prompt = models["local"].tokenize("The three primary colours are")
        speeds: dict[str, list[float]] = {name: [] for name in models}
        outputs: dict[str, list[int]] = {}
        for _ in range(args.reps):
            for name, model in models.items():  # interleaved: a slow spell of the machine hits both
                model.clear()
                token = int(model.decode(prompt, 0).ids[0, 0])
                out = []
                t = time.perf_counter()
                for i in range(args.tokens):
                    out.append(token)
                    token = int(model.decode([token], len(prompt) + i).ids[0, 0])
                speeds[name].append(args.tokens / (time.perf_counter() - t))
                outputs[name] = out
        for name, v in speeds.items():
            median = statistics.median(v)
            print(f"{name:6} {median:7.1f} tok/s (min {min(v):.1f}, max {max(v):.1f}), {1000 / median:.1f} ms a token")
        print("same tokens:", outputs["local"] == outputs["rpc"])
        for model in models.values():
            model.close()
    finally:
        server.terminate()
        server.wait()
    return 0


if __name__ == "__main__":
    sys.exit(main())
