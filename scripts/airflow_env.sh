# Source this to point Airflow at this checkout; nothing lands in $HOME.
_repo="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
export AIRFLOW_HOME="${AIRFLOW_HOME:-$_repo/.work/airflow}"
export AIRFLOW__CORE__DAGS_FOLDER="$_repo/dags"
export AIRFLOW__CORE__PLUGINS_FOLDER="$_repo/plugins"
export AIRFLOW__CORE__LOAD_EXAMPLES=False
export AIRFLOW__CORE__PARALLELISM="${AIRFLOW__CORE__PARALLELISM:-4}"
export AIRFLOW__CORE__EXECUTOR="${AIRFLOW__CORE__EXECUTOR:-LocalExecutor}"
export AIRFLOW__DAG_PROCESSOR__REFRESH_INTERVAL="${AIRFLOW__DAG_PROCESSOR__REFRESH_INTERVAL:-5}"
export AIRFLOW__SCHEDULER__ENABLE_HEALTH_CHECK=False
export AIRFLOW__API__EXPOSE_CONFIG=False
mkdir -p "$AIRFLOW_HOME"
unset _repo
