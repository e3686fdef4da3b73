from aibrix_operators.sensors.scaling import AutoscaleSensor, RolesReadySensor, ScaleDownOperator

__all__ = ["AutoscaleSensor", "RolesReadySensor", "ScaleDownOperator"]
