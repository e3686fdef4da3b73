from aibrix_operators.operators.batch import (
    MergeBatchOperator,
    RecordBatchFailureOperator,
    SplitBatchOperator,
    ValidateBatchOperator,
)
from aibrix_operators.operators.dispatch import DispatchShardOperator

__all__ = [
    "DispatchShardOperator",
    "MergeBatchOperator",
    "RecordBatchFailureOperator",
    "SplitBatchOperator",
    "ValidateBatchOperator",
]
