"""AIBrix-style offline batch inference for Airflow.

Core modules (``batch``, ``storage``, ``driver``, ``serving``) import no Airflow so
that the slim driver image can use them; ``operators`` and ``plugin`` adapt them
to Airflow.
"""
