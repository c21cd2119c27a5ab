"""The transformers-model trace (`longctx.integrations.transformers.memory.step_memory`) against the peaks a
`longctx bench transformers` run measured: for each longctx row of the result JSONs given, the predicted peak of the
same model, adapters and `apply` settings, and predicted / measured. Runs on the CPU (seconds a row).

    python dev/hf_peak_check.py benchmarks/results/transformers_H200_llama-8b_lora.json \\
        benchmarks/results/transformers_H200_llama-8b_lora_128k.json
"""

from __future__ import annotations

import json
import sys


def main(paths: list[str]) -> None:
    from longctx.bench.transformers import predicted_peak

    for path in paths:
        with open(path) as f:
            run = json.load(f)
        meta = run["meta"]
        for provider, rows in run["ladder"].items():
            if not provider.startswith("longctx"):
                continue
            for r in rows:
                if r["status"] != "ok":
                    continue
                model, rank = meta.get("model", "llama"), meta.get("lora_rank")
                pred = predicted_peak(provider, meta["shape"], r["s"], model, rank)
                print(
                    f"{path}: {provider} S={r['s']}: measured {r['peak_bytes'] / 2**30:.2f} GiB, predicted "
                    f"{pred / 2**30:.2f} GiB, {pred / r['peak_bytes']:.3f}"
                )


if __name__ == "__main__":
    main(sys.argv[1:])
