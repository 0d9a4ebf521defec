"""The results file: its default path, and JSON written atomically, with
non-finite floats as null."""
import json
import math
import os

RESULTS_DIR = "results"  # the tools' default output directory, under the working directory (ignored by git)


def default_out_path(env):
    gpu = env.get("gpu", "gpu").lower().replace("nvidia", "").strip().replace(" ", "-") or "gpu"
    return os.path.join(RESULTS_DIR, f"{gpu}x{env['world_size']}.json")


def write_json(path, data):
    """Writes atomically (a partial write never replaces a good file)."""
    d = os.path.dirname(path)
    if d:
        os.makedirs(d, exist_ok=True)
    tmp = path + ".tmp"
    with open(tmp, "w") as f:
        json.dump(_jsonable(data), f, indent=1)
        f.write("\n")
    os.replace(tmp, path)


def read_json(path):
    with open(path) as f:
        return json.load(f)


def _jsonable(x):
    if isinstance(x, dict):
        return {str(k): _jsonable(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [_jsonable(v) for v in x]
    if isinstance(x, float) and not math.isfinite(x):
        return None
    return x
