"""dtrain.toml < DTRAIN_* < flags, resolved without the CLI."""

from __future__ import annotations

import textwrap
from pathlib import Path

import pytest

from dtrain.common.config import Precision, RunConfig, scalar_fields
from dtrain.common.errors import UserError
from dtrain.control import backends
from dtrain.control import settings as S
from dtrain.control.settings import (
    describe,
    env_name,
    get_cluster,
    load_settings,
    schema,
)
from dtrain.control.workloads import WORKLOADS, Builtin, workload_class
from dtrain.mnist.config import Dataset, MnistConfig

# The backends as the errors list them: from the registry, so that a new backend is one line there (and its module).
QUOTED = " | ".join(f'"{n}"' for n in backends.names())


@pytest.fixture
def cwd(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    return tmp_path


def write(path: Path, text: str) -> Path:
    path.write_text(textwrap.dedent(text))
    return path


def error(**kw) -> str:
    kw.setdefault("env", {})
    with pytest.raises(UserError) as e:
        load_settings(**kw)
    return str(e.value)


# ---------------------------------------------------------------------------------------------
# precedence and sources


def test_defaults_without_a_file(cwd):
    s = load_settings(env={})
    assert s.file is None
    assert s.run == RunConfig()
    assert (s.launch.nproc, s.launch.cluster, s.launch.max_restarts) == (0, "", 0)
    assert s.workload("mnist") == MnistConfig()
    assert s.source("mnist.epochs") == "default"
    assert s.clusters == {}
    assert s.explicit("mnist") == {}


def test_precedence_default_file_env_flag(cwd):
    assert load_settings(env={}).workload("mnist").epochs == MnistConfig().epochs

    write(cwd / "dtrain.toml", "[mnist]\nepochs = 3\n")
    s = load_settings(env={})
    assert (s.workload("mnist").epochs, s.source("mnist.epochs")) == (3, "dtrain.toml")

    env = {"DTRAIN_MNIST_EPOCHS": "4"}
    s = load_settings(env=env)
    assert (s.workload("mnist").epochs, s.source("mnist.epochs")) == (4, "DTRAIN_MNIST_EPOCHS")

    s = load_settings(flags={"mnist.epochs": 5}, env=env)
    assert (s.workload("mnist").epochs, s.source("mnist.epochs")) == (5, "--epochs")

    # None is "flag not given": the variable stays in charge.
    s = load_settings(flags={"mnist.epochs": None}, env=env)
    assert (s.workload("mnist").epochs, s.source("mnist.epochs")) == (4, "DTRAIN_MNIST_EPOCHS")


def test_run_section_fills_the_workloads_nested_run(cwd):
    write(
        cwd / "dtrain.toml",
        """
        [run]
        output = "gs://bucket/runs"
        precision = "bf16"
        nproc = 2
    """,
    )
    s = load_settings(flags={"run.seed": 7}, env={"DTRAIN_PRECISION": "fp32", "DTRAIN_NPROC": "4"})
    cfg = s.workload("mnist")
    assert cfg.run == RunConfig(output="gs://bucket/runs", precision=Precision.FP32, seed=7)
    assert s.run == cfg.run
    assert s.launch.nproc == 4
    keys = ("run.output", "run.precision", "run.seed", "run.nproc", "run.log_every")
    assert [s.source(k) for k in keys] == ["dtrain.toml", "DTRAIN_PRECISION", "--seed", "DTRAIN_NPROC", "default"]


def test_explicit_has_workload_and_run_keys_but_not_launcher_ones(cwd):
    write(
        cwd / "dtrain.toml",
        """
        [run]
        output = "out"
        nproc = 2
        cluster = ""
        [mnist]
        dataset = "fashion-mnist"
    """,
    )
    s = load_settings(
        flags={"mnist.epochs": 2, "run.max_restarts": 1, "mnist.augment": False}, env={"DTRAIN_SEED": "3"}
    )
    assert s.explicit("mnist") == {
        "output": "out",
        "seed": 3,
        "dataset": Dataset.FASHION_MNIST,
        "epochs": 2,
        "augment": False,
    }


def test_config_path_is_the_source_label(tmp_path, cwd):
    (tmp_path / "conf").mkdir()
    elsewhere = write(tmp_path / "conf" / "x.toml", "[mnist]\nlr = 0.01\n")
    write(cwd / "dtrain.toml", "[mnist]\nlr = 0.5\n")  # ignored: --config wins
    s = load_settings(elsewhere, env={})
    assert s.file == elsewhere
    assert (s.workload("mnist").lr, s.source("mnist.lr")) == (0.01, str(elsewhere))


def test_env_values_are_parsed_per_type(cwd):
    s = load_settings(
        env={
            "DTRAIN_MNIST_AUGMENT": "no",
            "DTRAIN_MNIST_LR": "1e-2",
            "DTRAIN_MNIST_DATA_DIR": "/data",
            "DTRAIN_MNIST_DATASET": "fashion-mnist",
            "DTRAIN_OUTPUT": "gs://b/p",
            "DTRAIN_CLUSTER": "gpu",
            "DTRAIN_MAX_RESTARTS": "2",
            "DTRAIN_DIST_TIMEOUT": "30",
            # reserved for the CLI itself or for launcher plumbing: ignored here
            "DTRAIN_CONFIG": "nowhere.toml",
            "DTRAIN_DEBUG": "1",
            "DTRAIN_INTERNAL_ANYTHING": "x",
            "OTHER": "x",
        }
    )
    m = s.workload("mnist")
    assert (m.augment, m.lr, m.data_dir, m.dataset) == (False, 0.01, "/data", Dataset.FASHION_MNIST)
    assert (s.run.output, s.run.dist_timeout) == ("gs://b/p", 30.0)
    assert (s.launch.cluster, s.launch.max_restarts) == ("gpu", 2)


def test_flags_labels_and_types(cwd):
    s = load_settings(
        flags={
            "mnist.augment": False,
            "mnist.download": True,
            "run.output": Path("out"),
            "mnist.data_dir": "d",
            "run.precision": Precision.BF16,
        },
        env={},
    )
    assert [s.source(k) for k in ("mnist.augment", "mnist.download", "run.output", "mnist.data_dir")] == [
        "--no-augment",
        "--download",
        "--output",
        "--data-dir",
    ]
    assert (s.run.output, s.run.precision) == ("out", Precision.BF16)
    assert error(flags={"mnist.epochs": "many"}) == "--epochs: mnist.epochs must be an integer, got 'many'"
    with pytest.raises(ValueError, match="no setting 'mnist.nope'"):
        load_settings(flags={"mnist.nope": 1}, env={})


def test_items_for_display(cwd):
    write(cwd / "dtrain.toml", '[run]\nprecision = "fp16"\n[clusters.gpu]\nbackend = "gcp"\n')
    items = load_settings(env={}).items("mnist")
    keys = [i.key for i in items]
    assert keys[0] == "run.output" and keys[-1] == "clusters.gpu.backend"
    assert keys.index("run.max_restarts") < keys.index("mnist.dataset")
    by_key = {i.key: i for i in items}
    assert by_key["run.precision"].as_dict() == {"key": "run.precision", "value": "fp16", "source": "dtrain.toml"}
    assert by_key["clusters.gpu.backend"].value == "gcp"
    assert by_key["run.nproc"].help.startswith("processes per node")
    assert error_of(lambda: load_settings(env={}).items("gpt")) == "unknown workload 'gpt' (known: lora, mnist)"


def error_of(fn) -> str:
    with pytest.raises(UserError) as e:
        fn()
    return str(e.value)


# ---------------------------------------------------------------------------------------------
# file errors


def test_missing_default_file_is_fine_but_missing_config_is_an_error(cwd):
    assert load_settings(env={}).file is None
    assert error(config_path=Path("nope.toml")) == (
        "config file nope.toml not found (given by --config or DTRAIN_CONFIG)"
    )
    assert error(config_path=cwd) == f"config file {cwd} is not a file (given by --config or DTRAIN_CONFIG)"


def test_invalid_toml_names_file_line_and_column(cwd):
    write(cwd / "dtrain.toml", "[mnist]\nepochs = \n")
    msg = error()
    assert msg.startswith("dtrain.toml: invalid TOML: ")
    assert "(at line 2, column 10)" in msg


def test_unknown_key_names_key_and_file(cwd):
    write(cwd / "dtrain.toml", "[mnist]\nepoch = 3\n")
    assert error() == "dtrain.toml: unknown key mnist.epoch (did you mean mnist.epochs?)"
    write(cwd / "dtrain.toml", "[mnist]\nzzz = 3\n")
    assert error().startswith("dtrain.toml: unknown key mnist.zzz (known in [mnist]: dataset, data_dir, ")
    write(cwd / "dtrain.toml", "[mnist]\nnproc = 3\n")
    assert error() == "dtrain.toml: unknown key mnist.nproc (nproc belongs in [run])"
    write(cwd / "dtrain.toml", "[run]\nepochs = 3\n")
    assert error() == "dtrain.toml: unknown key run.epochs (epochs belongs in [mnist])"


def test_unknown_section_and_keys_outside_sections(cwd):
    write(cwd / "dtrain.toml", "[mnsit]\nepochs = 3\n")
    assert (
        error() == "dtrain.toml: unknown section [mnsit] (known: [run], [mnist], [lora], [clusters.NAME], [jobs.NAME])"
    )
    write(cwd / "dtrain.toml", "epochs = 3\n")
    assert error() == "dtrain.toml: epochs = ... is outside any section; put it under [mnist]"
    write(cwd / "dtrain.toml", "run = 3\n")
    assert error() == "dtrain.toml: run must be a table ([run]), got an integer"


@pytest.mark.parametrize(
    ("toml", "message"),
    [
        ('[mnist]\nepochs = "ten"', "dtrain.toml: mnist.epochs must be an integer, got 'ten'"),
        ("[mnist]\nepochs = 1.5", "dtrain.toml: mnist.epochs must be an integer, got 1.5"),
        ("[mnist]\naugment = 1", "dtrain.toml: mnist.augment must be a boolean, got 1"),
        ("[mnist]\ndata_dir = 3", "dtrain.toml: mnist.data_dir must be a string, got int 3"),
        ("[run]\nprecision = 16", "dtrain.toml: run.precision must be one of auto | bf16 | fp16 | fp32, got 16"),
        (
            '[mnist]\ndataset = "emnist"',
            "dtrain.toml: mnist.dataset must be one of mnist | fashion-mnist, got 'emnist'",
        ),
    ],
)
def test_wrong_types_name_key_and_expected_type(cwd, toml, message):
    write(cwd / "dtrain.toml", toml + "\n")
    assert error() == message


def test_int_is_accepted_for_a_float(cwd):
    write(cwd / "dtrain.toml", "[run]\ndist_timeout = 60\n")
    assert load_settings(env={}).run.dist_timeout == 60.0


def test_dataclass_validation_names_key_and_source(cwd):
    write(cwd / "dtrain.toml", "[run]\nlog_every = 0\n")
    assert error() == "invalid configuration: run.log_every (from dtrain.toml): must be >= 1"
    (cwd / "dtrain.toml").unlink()
    assert error(flags={"run.nproc": -1}) == ("invalid configuration: run.nproc (from --nproc): must be >= 0, got -1")

    # Workload checks run when the workload's config is built (and by `config show`).
    s = load_settings(env={"DTRAIN_MNIST_EPOCHS": "0"})
    expected = "invalid configuration: mnist.epochs (from DTRAIN_MNIST_EPOCHS): must be >= 1, got 0"
    assert error_of(lambda: s.workload("mnist")) == expected
    assert error_of(lambda: describe(s)) == expected
    assert error_of(lambda: describe(s, "mnist")) == expected


# ---------------------------------------------------------------------------------------------
# environment


def test_bad_env_value_names_the_variable(cwd):
    assert error(env={"DTRAIN_MNIST_EPOCHS": "ten"}) == (
        "DTRAIN_MNIST_EPOCHS: mnist.epochs must be an integer, got 'ten'"
    )
    assert error(env={"DTRAIN_PRECISION": "int8"}) == (
        "DTRAIN_PRECISION: run.precision must be one of auto | bf16 | fp16 | fp32, got 'int8'"
    )
    assert error(env={"DTRAIN_MNIST_AUGMENT": "maybe"}) == (
        "DTRAIN_MNIST_AUGMENT: mnist.augment must be a boolean, got 'maybe'"
    )


def test_unknown_env_variable_is_named(cwd):
    assert error(env={"DTRAIN_FOO": "1"}) == (
        "unknown environment variable DTRAIN_FOO (run.X is DTRAIN_X, <section>.X is DTRAIN_<SECTION>_X); "
        "unset it or fix its name"
    )
    assert error(env={"DTRAIN_MNIST_EPOCH": "1"}) == (
        "unknown environment variable DTRAIN_MNIST_EPOCH (did you mean DTRAIN_MNIST_EPOCHS?); unset it or fix its name"
    )
    assert error(env={"DTRAIN_EPOCHS": "1"}) == (
        "unknown environment variable DTRAIN_EPOCHS (did you mean DTRAIN_LORA_EPOCHS or DTRAIN_MNIST_EPOCHS?); "
        "unset it or fix its name"
    )


def test_env_names():
    assert env_name("run.nproc") == "DTRAIN_NPROC"
    assert env_name("run.output") == "DTRAIN_OUTPUT"
    assert env_name("mnist.data_dir") == "DTRAIN_MNIST_DATA_DIR"


def test_no_two_keys_share_an_env_name_and_none_is_reserved():
    names = [env_name(k) for k in schema()]
    assert len(names) == len(set(names)), sorted(n for n in names if names.count(n) > 1)
    assert not [n for n in names if n in S.RESERVED_ENV or n.startswith(S.INTERNAL_ENV_PREFIX)]


@pytest.mark.parametrize("workload", sorted(WORKLOADS))
def test_workload_fields_do_not_shadow_run_fields(workload):
    # Workloads are built from flat keys (and take flat flags), so names must be unique.
    flat = [name for name, _, _ in scalar_fields(workload_class(workload))]
    assert len(flat) == len(set(flat))
    assert {k.split(".", 1)[1] for k in schema() if k.startswith("run.")} >= {
        name for name, f, _ in scalar_fields(RunConfig) if not f.metadata.get("internal")
    }


# ---------------------------------------------------------------------------------------------
# clusters


def test_clusters_are_parsed(cwd):
    write(
        cwd / "dtrain.toml",
        """
        [run]
        cluster = "lab"
        [clusters.lab]
        backend = "hosts"
        [clusters.cloud]
        backend = "gcp"
    """,
    )
    s = load_settings(env={})
    backends = {n: c.backend for n, c in s.clusters.items()}
    assert backends == {"lab": "hosts", "cloud": "gcp"}
    assert s.source("clusters.cloud.backend") == "dtrain.toml"
    assert get_cluster(s).backend == "hosts"
    assert get_cluster(s, "cloud").backend == "gcp"
    assert get_cluster(s, "").backend == "local"


def test_unknown_cluster_is_only_an_error_when_asked_for(cwd):
    write(cwd / "dtrain.toml", '[clusters.lab]\nbackend = "hosts"\n[clusters.cloud]\nbackend = "gcp"\n')
    s = load_settings(flags={"run.cluster": "gpu"}, env={})
    assert s.launch.cluster == "gpu"
    assert error_of(lambda: get_cluster(s)) == (
        "unknown cluster 'gpu' (from --cluster); dtrain.toml defines: cloud, lab"
    )
    assert error_of(lambda: get_cluster(s, "x")) == "unknown cluster 'x'; dtrain.toml defines: cloud, lab"

    (cwd / "dtrain.toml").unlink()
    s = load_settings(env={"DTRAIN_CLUSTER": "gpu"})
    assert error_of(lambda: get_cluster(s)) == (
        "unknown cluster 'gpu' (from DTRAIN_CLUSTER); no clusters are defined: add a [clusters.gpu] table "
        f"with backend = {QUOTED} to dtrain.toml"
    )
    assert get_cluster(load_settings(env={})).backend == "local"


@pytest.mark.parametrize(
    ("toml", "message"),
    [
        (
            '[clusters.gpu]\nbackend = "gcp"\nzones = "x"',
            "dtrain.toml [clusters.gpu]: unknown key 'zones' (did you mean zone?)",
        ),
        (
            '[clusters.gpu]\nbackends = "gcp"',
            "dtrain.toml: unknown key clusters.gpu.backends (did you mean clusters.gpu.backend?)",
        ),
        (
            '[clusters.gpu]\nbackend = "aws"',
            f"dtrain.toml: clusters.gpu.backend must be one of {' | '.join(backends.names())}, got 'aws'",
        ),
        (
            "[clusters.gpu]\n",
            f"dtrain.toml: clusters.gpu.backend is required (one of {QUOTED})",
        ),
        ('clusters = "gpu"', "dtrain.toml: clusters must be tables [clusters.NAME], got a string"),
        ('[clusters]\ngpu = "gcp"', "dtrain.toml: clusters.gpu must be a table ([clusters.gpu]), got a string"),
    ],
)
def test_cluster_errors(cwd, toml, message):
    write(cwd / "dtrain.toml", toml + "\n")
    assert error() == message


# ---------------------------------------------------------------------------------------------
# adding a workload is one registry entry


TOY = """
import dataclasses
from dtrain.common.config import RunConfig, opt

@dataclasses.dataclass(kw_only=True)
class ToyConfig:
    run: RunConfig = dataclasses.field(default_factory=RunConfig)
    model: str = dataclasses.field(metadata={"help": "what to fine-tune"})
    max_steps: int = opt(100, "optimizer steps")
"""


def test_a_registered_workload_gets_a_section_variables_and_rows(tmp_path, cwd, monkeypatch):
    (tmp_path / "toy_workload_config.py").write_text(TOY)
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setitem(WORKLOADS, "toy", Builtin("toy_workload_config:ToyConfig", "toy_workload.train"))
    write(cwd / "dtrain.toml", "[run]\nseed = 1\n[toy]\nmax_steps = 5\n")

    s = load_settings(env={"DTRAIN_TOY_MAX_STEPS": "6"})
    assert s.source("toy.max_steps") == "DTRAIN_TOY_MAX_STEPS"
    # A required key left unset shows as such, and is an error only when the workload is built.
    rows = {i.key: i for i in describe(s)}
    assert (rows["toy.model"].value, rows["toy.model"].source) == (None, "required")
    assert "toy.max_steps" in rows and "mnist.epochs" in rows
    assert error_of(lambda: s.workload("toy")) == (
        "toy.model is required: set it with --model, DTRAIN_TOY_MODEL or model = ... in [toy]"
    )
    assert s.explicit("toy") == {"seed": 1, "max_steps": 6}

    s = load_settings(flags={"toy.model": "tiny"}, env={})
    cfg = s.workload("toy")
    assert (cfg.model, cfg.max_steps, cfg.run.seed) == ("tiny", 5, 1)
    assert "mnist.epochs" not in {i.key for i in describe(s, "toy")}


def test_a_resumed_runs_saved_config_sits_beneath_file_env_and_flags(cwd):
    saved = (
        "runs/r/config.json",
        "lora",
        {
            "model": "tiny-llama",
            "data": "a.txt",
            "lora_r": 4,
            "seed": 7,
            "output": "elsewhere",
            "run_id": "r",
            "not_a_key_any_more": 1,
        },
    )
    s = load_settings(env={}, saved=saved)
    cfg = s.workload("lora")
    assert (cfg.model, cfg.data, cfg.lora_r, cfg.run.seed) == ("tiny-llama", "a.txt", 4, 7)
    assert s.source("lora.lora_r") == "runs/r/config.json" and s.source("run.seed") == "runs/r/config.json"
    assert s.run.output == "runs" and s.run.run_id == ""  # where a run lives is never inherited
    write(cwd / "dtrain.toml", "[lora]\nlora_r = 8\n")
    s = load_settings(env={"DTRAIN_SEED": "9"}, flags={"lora.data": "b.txt"}, saved=saved)
    assert (s.workload("lora").lora_r, s.workload("lora").data, s.run.seed) == (8, "b.txt", 9)
    assert (s.source("lora.lora_r"), s.source("lora.data"), s.source("run.seed")) == (
        "dtrain.toml",
        "--data",
        "DTRAIN_SEED",
    )
