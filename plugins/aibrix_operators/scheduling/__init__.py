"""How Airflow schedules the pipeline's tasks: deadline weights, ``max_workers`` turns, the
settings under which a lost node costs a minute, and the single-machine deployment's executor.

Everything here reaches Airflow through its public seams (a cluster policy registered by the
deployment's ``airflow_local_settings.py``, ``AirflowRescheduleException``, configuration, an
executor built on ``LocalExecutor``'s public methods); ``docs/scheduling.md`` says what holds on
each executor and why.
"""
