"""The tensorboard, mlflow and wandb backends against the real packages: values logged are read back
(mlflow: the default sqlite store and artifact folder in the output directory; wandb: offline mode)."""

from __future__ import annotations

import json

from rlhf.ops.metrics import MetricsLogger

CONFIG = {"actor": {"lr": 1e-6, "betas": [0.9, 0.99]}, "algorithm": {"gdpo_reward_weights": None},
          "trainer": {"logger": ["console", "mlflow"], "alerts": {"kl_to_ref": 1.0}, "experiment_name": "exp"}}
VAL = {"val/synthetic/addition/pass@1": 0.5, "val/pass@4": 0.75, "val/acc": 0.5}
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


def test_mlflow_store_metrics_hyperparameters_and_generation_table_read_back(tmp_path, monkeypatch):
    import mlflow
    from mlflow.tracking import MlflowClient

    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    with MetricsLogger(tmp_path, backends=("mlflow", "jsonl"), total_steps=2, project="proj", experiment="exp",
                       config=CONFIG) as logger:
        logger.log(0, VAL)
        logger.log(1, {"reward/mean": 0.25})
        logger.log(2, {"reward/mean": 0.75})
        logger.log_generations(2, ROWS)
        run_id = mlflow.active_run().info.run_id
    client = MlflowClient(tracking_uri=f"sqlite:///{(tmp_path / 'mlflow.db').resolve()}")
    history = client.get_metric_history(run_id, "reward/mean")
    assert sorted((m.step, m.value) for m in history) == [(1, 0.25), (2, 0.75)]
    # mlflow refuses "@" in names: pass@k is logged as pass_at_k there; metrics.jsonl keeps the names.
    run = client.get_run(run_id)
    assert {k: v for k, v in run.data.metrics.items() if k.startswith("val/")} == {
        "val/synthetic/addition/pass_at_1": 0.5, "val/pass_at_4": 0.75, "val/acc": 0.5}
    assert set(VAL) <= set(json.loads((tmp_path / "metrics.jsonl").read_text().splitlines()[0]))
    # The resolved config, flattened, as the run's parameters.
    assert run.data.params == {"actor.lr": "1e-06", "actor.betas": "[0.9, 0.99]", "algorithm.gdpo_reward_weights": "None",
                               "trainer.logger": "['console', 'mlflow']", "trainer.alerts.kl_to_ref": "1.0",
                               "trainer.experiment_name": "exp"}
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




def test_tensorboard_names_with_at_sign_and_hyperparameters_read_back(tmp_path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    from tensorboard.plugins.hparams import plugin_data_pb2

    with MetricsLogger(tmp_path, backends=("tensorboard",), total_steps=2, experiment="exp", config=CONFIG) as logger:
        logger.log(0, VAL)
    acc = EventAccumulator(str(tmp_path / "tensorboard" / "exp"))
    acc.Reload()
    assert {k: acc.Scalars(k)[0].value for k in VAL} == VAL
    content = acc.PluginTagToContent("hparams")["_hparams_/session_start_info"]
    hparams = plugin_data_pb2.HParamsPluginData.FromString(content).session_start_info.hparams
    assert hparams["actor.lr"].number_value == 1e-6 and hparams["actor.betas"].string_value == "[0.9, 0.99]"
    assert hparams["trainer.alerts.kl_to_ref"].number_value == 1.0 and "algorithm.gdpo_reward_weights" not in hparams
    (text,) = acc.Tensors("config/text_summary")
    assert "lr: 1.0e-06" in text.tensor_proto.string_val[0].decode()


def _wandb_run(run_file):
    """(run record, [history rows]) of an offline wandb run file. wandb's writer process may still be
    flushing the file when ``finish`` returns (once seen in CI: no run record), so it is read again
    for up to 10 s until the run record is there."""
    import time

    from wandb.proto import wandb_internal_pb2

    for _ in range(50):
        run, history = None, []
        for raw in _wandb_records(run_file):
            rec = wandb_internal_pb2.Record()
            rec.ParseFromString(raw)
            if rec.WhichOneof("record_type") == "run":
                run = rec.run
            elif rec.WhichOneof("record_type") == "history":
                history.append({(i.key or "/".join(i.nested_key)): json.loads(i.value_json)
                                for i in rec.history.item})
        if run is not None:
            break
        time.sleep(0.2)
    return run, history


def test_wandb_names_hyperparameters_and_resume_continue_one_run(tmp_path, monkeypatch):
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    monkeypatch.delenv("WANDB_RUN_ID", raising=False)
    for first, last in ((0, 1), (2, 3)):  # a job, then its resumed continuation in the same output_dir
        with MetricsLogger(tmp_path, backends=("wandb",), total_steps=3, project="proj", experiment="exp",
                           config=CONFIG) as logger:
            logger.mark_start(first)
            for step in range(first, last + 1):
                logger.log(step, {**VAL, "reward/mean": step / 10})
    files = sorted((tmp_path / "wandb").glob("offline-run-*/run-*.wandb"))
    assert len(files) == 2
    (run1, hist1), (run2, hist2) = _wandb_run(files[0]), _wandb_run(files[1])
    assert run1.run_id == run2.run_id and files[0].name == files[1].name  # one run, continued
    config = {i.key: json.loads(i.value_json) for i in run2.config.update}
    assert config["actor.lr"] == 1e-6 and config["trainer.alerts.kl_to_ref"] == 1.0
    assert [h["_step"] for h in hist1 + hist2] == [0, 1, 2, 3]
    assert all(h["val/synthetic/addition/pass@1"] == 0.5 for h in hist1 + hist2)
    # Another output directory is another run.
    with MetricsLogger(tmp_path / "other", backends=("wandb",), total_steps=1, project="proj", experiment="exp"):
        pass
    (other,) = (tmp_path / "other" / "wandb").glob("offline-run-*/run-*.wandb")
    assert other.name != files[0].name


def test_mlflow_resumed_job_continues_its_run(tmp_path, monkeypatch):
    import mlflow
    from mlflow.tracking import MlflowClient

    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    run_ids = []
    # a job, then its resumed continuation in the same output_dir with one setting changed
    for (first, last), steps in (((1, 2), 4), ((3, 4), 8)):
        config = {**CONFIG, "trainer": {**CONFIG["trainer"], "total_training_steps": steps}}
        with MetricsLogger(tmp_path, backends=("mlflow",), total_steps=steps, project="proj", experiment="exp",
                           config=config) as logger:
            for step in range(first, last + 1):
                logger.log(step, {"reward/mean": step / 10})
            run_ids.append(mlflow.active_run().info.run_id)
    assert run_ids[0] == run_ids[1]
    client = MlflowClient(tracking_uri=f"sqlite:///{(tmp_path / 'mlflow.db').resolve()}")
    history = client.get_metric_history(run_ids[0], "reward/mean")
    assert sorted(m.step for m in history) == [1, 2, 3, 4]
    run = client.get_run(run_ids[0])
    # mlflow cannot change a parameter: the first value stays, the change is named in a tag
    assert run.data.params["trainer.total_training_steps"] == "4"
    assert run.data.tags["rlhf.params_changed_on_resume"] == "trainer.total_training_steps"
    assert len(client.search_runs([run.info.experiment_id])) == 1
    # a stored id the store no longer has (run deleted) starts a new run; another directory is another run
    client.delete_run(run_ids[0])
    with MetricsLogger(tmp_path, backends=("mlflow",), total_steps=1, project="proj", experiment="exp"):
        assert mlflow.active_run().info.run_id != run_ids[0]
    with MetricsLogger(tmp_path / "other", backends=("mlflow",), total_steps=1, project="proj", experiment="exp"):
        assert mlflow.active_run().info.run_id != run_ids[0]
