from aibrix_operators.operators.batch import (
    MergeBatchOperator,
    SplitBatchOperator,
    ValidateBatchOperator,
)
from aibrix_operators.operators.dispatch import DispatchShardOperator

__all__ = [
    "DispatchShardOperator",
    "MergeBatchOperator",
    "SplitBatchOperator",
    "ValidateBatchOperator",
]
