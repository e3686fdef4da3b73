"""The deployment's Airflow local settings: the pipeline's cluster policy.

Airflow imports ``airflow_local_settings`` from ``$AIRFLOW_HOME/config`` or the plugins folder
and registers the policies it defines (its documented place for cluster policies). The Airflow
image copies this file to ``$AIRFLOW_HOME/config``; the local stack finds it in the plugins
folder; with the Helm chart, give this file's text as ``airflowLocalSettings``. A deployment that
has its own ``airflow_local_settings.py`` adds the import below to it and, if it defines its own
``task_instance_mutation_hook`` too, calls ours from it.
"""

from aibrix_operators.scheduling.deadline_order import task_instance_mutation_hook

__all__ = ["task_instance_mutation_hook"]
