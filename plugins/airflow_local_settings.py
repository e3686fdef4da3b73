"""The deployment's Airflow local settings: the pipeline's cluster policy, and its modules imported
once in the components that fork a DAG parse per task.

Airflow imports ``airflow_local_settings`` from ``$AIRFLOW_HOME/config`` or the plugins folder
and registers the policies it defines (its documented place for cluster policies). The Airflow
image copies this file to ``$AIRFLOW_HOME/config``; the local stack finds it in the plugins
folder; with the Helm chart, give this file's text as ``airflowLocalSettings``. A deployment that
has its own ``airflow_local_settings.py`` adds the lines below to it and, if it defines its own
``task_instance_mutation_hook`` too, calls ours from it.
"""

from aibrix_operators.scheduling.deadline_order import task_instance_mutation_hook
from aibrix_operators.settings.warm_imports import warm

# The scheduler, the dag-processor and the Celery and Edge workers import the pipeline once, so
# their forks (a task each, a DAG file each) do not (aibrix_operators/settings/warm_imports.py).
warm()

# Only the policy: every other name listed here would become an attribute of airflow.settings.
__all__ = ["task_instance_mutation_hook"]
