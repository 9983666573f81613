"""opttree: Megatron-Core optimizer stacks as typed trees, inspectable and safely resettable."""

import logging

from opttree._api import describe, reset, sync_masters, validate
from opttree._checkpoints import load_state_dict, sharded_state_dict
from opttree._history import prune, scale
from opttree._describe import DescribeVisitor, Summary
from opttree._errors import (
    HiddenOptimizer,
    MalformedWrapper,
    NotAnOptimizer,
    OptimizerCycle,
    OptTreeError,
    PartialResetRefused,
    ReleaseRefused,
    RegistrationError,
    StaleMaster,
    UnsupportedOptimizer,
    UnmappedParameter,
    UnknownWrapper,
    UnsupportedCheckpoint,
    UnsupportedOptimizerState,
)
from opttree._hooks import register_step_hook
from opttree._masters import SyncReport
from opttree._nodes import ChainedNode, HybridNode, LeafNode, Node, WrapperNode
from opttree._problems import Problem, ProblemKind, Severity
from opttree._registry import register_schema, register_wrapper, schema_for
from opttree._report import ResetReport
from opttree._reset import ResetVisitor
from opttree._schema import StateSchema, StepLocation, StepType
from opttree._trees import tree
from opttree._validate import ValidateVisitor
from opttree._version import __version__
from opttree._visitor import NodeVisitor, TraverserVisitor

logging.getLogger("opttree").addHandler(logging.NullHandler())

__all__ = [
    "ChainedNode",
    "DescribeVisitor",
    "HiddenOptimizer",
    "HybridNode",
    "LeafNode",
    "MalformedWrapper",
    "Node",
    "NodeVisitor",
    "NotAnOptimizer",
    "OptTreeError",
    "OptimizerCycle",
    "PartialResetRefused",
    "ReleaseRefused",
    "Problem",
    "ProblemKind",
    "RegistrationError",
    "ResetReport",
    "ResetVisitor",
    "Severity",
    "StaleMaster",
    "StateSchema",
    "StepLocation",
    "StepType",
    "Summary",
    "SyncReport",
    "TraverserVisitor",
    "UnknownWrapper",
    "UnmappedParameter",
    "UnsupportedCheckpoint",
    "UnsupportedOptimizer",
    "UnsupportedOptimizerState",
    "ValidateVisitor",
    "WrapperNode",
    "__version__",
    "describe",
    "load_state_dict",
    "prune",
    "register_schema",
    "register_step_hook",
    "register_wrapper",
    "reset",
    "scale",
    "schema_for",
    "sharded_state_dict",
    "sync_masters",
    "tree",
    "validate",
]
