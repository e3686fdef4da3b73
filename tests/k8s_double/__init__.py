"""A Kubernetes API double at the HTTP boundary, and a fake kubelet (no cluster can run here).

Real client code — the cncf-kubernetes provider, ``kubernetes``, ``kubernetes_asyncio`` —
talks HTTP to ``ApiServerDouble`` through a kubeconfig; ``FakeKubelet`` turns each pod
into a local process running the pod's command with its env (Secrets resolved from the
store) and reports phase, exit code, logs and Events back into the store.

    from tests.k8s_double import FakeCluster, Image

    with FakeCluster(tmp_path, images={"driver:1": Image({"python": sys.executable})}) as cluster:
        cluster.add_secret("batch", "s3", {"AWS_ACCESS_KEY_ID": "..."})
        env["AIRFLOW_CONN_KUBERNETES_DEFAULT"] = cluster.airflow_connection("batch")
        ...                                   # run code that creates pods
        cluster.kubelet.all_runs()            # what ran: argv, env names, exit codes, reasons
        cluster.api.fail("POST", r"/pods$", 403)     # next pod create is forbidden
        cluster.api.stall_watches(r"watch=true")     # watches send nothing until their timeout

Pytest fixture: ``fake_cluster`` in ``tests/k8s_double/fixtures.py`` (import it in a
conftest). Modules: ``api`` (server + store + selectors), ``kubelet`` (the node),
``cluster`` (wiring, kubeconfig, Airflow connection). What is *not* modelled is listed in
each module's docstring.
"""

from tests.k8s_double.api import ApiServerDouble, ObjectStore, label_selector_matches
from tests.k8s_double.cluster import FakeCluster
from tests.k8s_double.kubelet import FakeKubelet, Image, PodRun

__all__ = [
    "ApiServerDouble",
    "FakeCluster",
    "FakeKubelet",
    "Image",
    "ObjectStore",
    "PodRun",
    "label_selector_matches",
]
