#!/usr/bin/env bash
# Runs the checkpoint tests under several Pythons, each in its own venv, and prints one line per
# Python (its version, torch's, the pytest summary) and, last, one JSON object with them all.
#
# Why: a checkpoint's DCP metadata is a pickle, and how pickle writes some objects changes between
# Python releases (Debian 12's python3, 3.11.2, writes Enum members by name); the checkpoint
# tests are the ones that read what another Python may have written. CI runs one Python; this
# script is for the others. Not run by CI (each venv is a multi-GB torch install).
#
#   bash launch/python_versions.sh                      # /usr/bin/python3 and pyenv's 3.10 / 3.12 / 3.13
#   bash launch/python_versions.sh /usr/bin/python3     # the Pythons named
#   TESTS="tests/unit/test_dcp_metadata_pickle.py" bash launch/python_versions.sh ~/.pyenv/versions/3.13.0/bin/python
#
# Environment: VENVS (where the venvs go, default /tmp/rlhf-pythons), TORCH (the torch version,
# default 2.13.0: a Python without a local wheel gets PyPI's build, which is the CUDA one, several GB:
# check the disk), INSTALL_TIMEOUT / TEST_TIMEOUT (seconds per Python, default 3600 / 3600), TESTS.
# Logs: $VENVS/py<version>.install.log and .tests.log.
set -uo pipefail
cd "$(dirname "$0")/.."
ROOT=$PWD
VENVS=${VENVS:-/tmp/rlhf-pythons}
TORCH=${TORCH:-2.13.0}
INSTALL_TIMEOUT=${INSTALL_TIMEOUT:-3600}
TEST_TIMEOUT=${TEST_TIMEOUT:-3600}
# The tests that write a checkpoint and read it back (resume, export, eval of a checkpoint dir,
# kill and restart), plus the unit tests of the metadata reader.
TESTS=${TESTS:-"tests/unit/test_checkpoint_files.py tests/unit/test_dcp_metadata_pickle.py
  tests/e2e/test_resume.py tests/e2e/test_checkpoint_export.py
  tests/dist/test_checkpoint_export.py tests/dist/test_export_pp.py
  tests/e2e/test_fully_async.py::test_zero_staleness_equals_colocated_through_a_kill_and_resume
  tests/e2e/test_reliability.py::test_killed_rank_restarts_and_the_run_equals_an_uninterrupted_one
  tests/e2e/test_ppo_quickstart.py::test_ppo_runs_logs_critic_metrics_and_resumes
  tests/e2e/test_vlm_grpo.py::test_vlm_export_and_eval"}

if [ $# -eq 0 ]; then
  set -- /usr/bin/python3 "$HOME/.pyenv/versions/3.10.13/bin/python" "$HOME/.pyenv/versions/3.12.1/bin/python" \
    "$HOME/.pyenv/versions/3.13.0/bin/python"
fi
mkdir -p "$VENVS"
echo "disk free under $VENVS: $(df -h --output=avail "$VENVS" | tail -1 | tr -d ' ')"

json="["
for py in "$@"; do
  if ! ver=$("$py" -c 'import platform; print(platform.python_version())' 2>/dev/null); then
    echo "$py: not found"; json+="{\"python\": \"$py\", \"result\": \"not found\"},"; continue
  fi
  venv="$VENVS/py$ver" log="$VENVS/py$ver"
  t0=$(date +%s)
  torch_v="-" result=""
  if ! { [ -x "$venv/bin/python" ] || "$py" -m venv "$venv"; } >"$log.install.log" 2>&1; then
    result="venv failed (see $log.install.log)"
  elif ! timeout "$INSTALL_TIMEOUT" "$venv/bin/python" -m pip install -q "torch==$TORCH" -e "$ROOT[test]" \
      >>"$log.install.log" 2>&1; then
    result="install failed or passed ${INSTALL_TIMEOUT}s (see $log.install.log)"
  else
    torch_v=$("$venv/bin/python" -c 'import torch; print(torch.__version__)')
    t1=$(date +%s)
    # shellcheck disable=SC2086  # TESTS is a list of test ids
    PYTHONPATH=$ROOT timeout "$TEST_TIMEOUT" "$venv/bin/python" -m pytest -q -p no:xdist -p no:cacheprovider $TESTS \
      >"$log.tests.log" 2>&1
    rc=$?
    summary=$(grep -E '^(=+ )?[0-9]+ (passed|failed|error)' "$log.tests.log" | tail -1 | tr -d '=' | xargs)
    result="${summary:-no pytest summary} (rc $rc, tests $(( $(date +%s) - t1 ))s)"
    [ "$rc" = 124 ] && result="tests passed ${TEST_TIMEOUT}s: $result"
  fi
  echo "python $ver ($py), torch $torch_v: $result [install+tests $(( $(date +%s) - t0 ))s]"
  json+="{\"python\": \"$ver\", \"interpreter\": \"$py\", \"torch\": \"$torch_v\", \"result\": \"$result\"},"
done
echo "{\"pythons\": ${json%,}]}"
