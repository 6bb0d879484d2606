nvidia-smi --query-gpu=name --format=csv,noheader; date -u
python3 scripts/bench_train.py --shapes c --stacks loongforge --variants-only --steps 8 --profile "" --variants "optimizer=model,optimizer=model fp8=adaptive" --out $OUT/train_c_adaptive.json > $OUT/train_c_adaptive.txt 2>&1; grep -A4 "^| stack" $OUT/train_c_adaptive.txt
python3 - <<'PY'
import json, os
d = json.load(open(os.environ["OUT"] + "/train_c_adaptive.json"))
def walk(o):
    if isinstance(o, dict):
        for k, v in o.items():
            if k == "fp8_table": print(v)
            else: walk(v)
    elif isinstance(o, list):
        for v in o: walk(v)
walk(d)
PY
date -u
timeout 200 python3 -m pytest -m gpu -q --tb=short -p no:warnings tests/kernels/test_gpu_fp8.py -k adaptive 2>&1 | tail -3
date -u
