"""The tensorboard, mlflow and wandb backends against the real packages: values logged are read back
(mlflow: the default sqlite store and artifact folder in the output directory; wandb: offline mode)."""

from __future__ import annotations

import json

from rlhf.metrics import MetricsLogger

ROWS = [{"key": 3, "sample": 0, "prompt": "1+2=", "response": "3 | ok\nyes", "ground_truth": "3", "score": 1.0}]


def test_tensorboard_scalars_and_generation_table_read_back(tmp_path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    with MetricsLogger(tmp_path, backends=("tensorboard",), total_steps=2, experiment="exp") as logger:
        logger.log(1, {"reward/mean": 0.25, "actor/loss": -1.5})
        logger.log(2, {"reward/mean": 0.75})
        logger.log_generations(2, ROWS)
    acc = EventAccumulator(str(tmp_path / "tensorboard" / "exp"))
    acc.Reload()
    assert [(e.step, e.value) for e in acc.Scalars("reward/mean")] == [(1, 0.25), (2, 0.75)]
    assert [(e.step, e.value) for e in acc.Scalars("actor/loss")] == [(1, -1.5)]
    (event,) = acc.Tensors("val/generations/text_summary")
    table = event.tensor_proto.string_val[0].decode()
    assert event.step == 2 and "| step | key | sample | prompt |" in table and "3 \\| ok<br>yes" in table


def test_mlflow_file_store_metrics_and_generation_table_read_back(tmp_path, monkeypatch):
    import mlflow
    from mlflow.tracking import MlflowClient

    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    with MetricsLogger(tmp_path, backends=("mlflow",), total_steps=2, project="proj", experiment="exp") as logger:
        logger.log(1, {"reward/mean": 0.25})
        logger.log(2, {"reward/mean": 0.75})
        logger.log_generations(2, ROWS)
        run_id = mlflow.active_run().info.run_id
    client = MlflowClient(tracking_uri=f"sqlite:///{(tmp_path / 'mlflow.db').resolve()}")
    history = client.get_metric_history(run_id, "reward/mean")
    assert sorted((m.step, m.value) for m in history) == [(1, 0.25), (2, 0.75)]
    path = client.download_artifacts(run_id, "generations/step_2.json", str(tmp_path / "dl"))
    table = json.loads(open(path).read())
    assert table["columns"][:3] == ["step", "key", "sample"] and table["data"][0][4] == "3 | ok\nyes"
    assert client.get_run(run_id).info.status == "FINISHED"
    assert (tmp_path / "mlartifacts").is_dir() and not (tmp_path.parent / "mlruns").exists()


def test_generations_jsonl_has_one_line_per_row_with_its_step(tmp_path):
    with MetricsLogger(tmp_path, backends=("jsonl",), total_steps=1) as logger:
        logger.log_generations(5, ROWS * 2)
    lines = [json.loads(x) for x in (tmp_path / "generations.jsonl").read_text().splitlines()]
    assert lines == [{"step": 5, **ROWS[0]}] * 2


def _wandb_records(path):
    """Protobuf records of a wandb run file: a ':W&B' header, then LevelDB-style log records
    (4-byte crc, 2-byte length, 1-byte type: full=1, first=2, middle=3, last=4) in 32 KiB blocks."""
    data = path.read_bytes()
    assert data[:4] == b":W&B"
    pos, block, records, parts = 7, 32768, [], b""
    while pos + 7 <= len(data):
        left = block - pos % block
        length, kind = int.from_bytes(data[pos + 4:pos + 6], "little"), data[pos + 6]
        if left < 7 or (length == 0 and kind == 0):  # block trailer / padding
            pos += left
            continue
        parts += data[pos + 7:pos + 7 + length]
        pos += 7 + length
        if kind in (1, 4):
            records.append(parts)
            parts = b""
    return records


def test_wandb_offline_history_read_back(tmp_path, monkeypatch):
    from wandb.proto import wandb_internal_pb2

    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    with MetricsLogger(tmp_path, backends=("wandb",), total_steps=2, project="proj", experiment="exp") as logger:
        logger.log(1, {"reward/mean": 0.25})
        logger.log(2, {"reward/mean": 0.75})
        logger.log_generations(2, ROWS)
    (run_file,) = (tmp_path / "wandb").glob("offline-run-*/run-*.wandb")
    history = []
    for raw in _wandb_records(run_file):
        rec = wandb_internal_pb2.Record()
        rec.ParseFromString(raw)
        if rec.WhichOneof("record_type") == "history":
            history.append({(i.key or "/".join(i.nested_key)): json.loads(i.value_json) for i in rec.history.item})
    assert [(h["_step"], h["reward/mean"]) for h in history if "reward/mean" in h] == [(1, 0.25), (2, 0.75)]
    row = next(h for h in history if "val/generations/_type" in h)
    assert (row["_step"], row["val/generations/_type"], row["val/generations/nrows"]) == (2, "table-file", 1)
    table = json.loads((run_file.parent / "files" / row["val/generations/path"]).read_text())
    assert table["columns"][:3] == ["step", "key", "sample"] and table["data"][0][4] == "3 | ok\nyes"
