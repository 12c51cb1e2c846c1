"""Verifiable tasks: reasoning-gym datasets, user JSONL/Parquet files and custom rewards."""

from mutualrl.tasks.base import (
    SUCCESS_THRESHOLD,
    Problem,
    Source,
    Task,
    extract_answer,
    problem_id,
)
from mutualrl.tasks.gym import GymSource, available_datasets, check_dataset
from mutualrl.tasks.jsonl import FileSource
from mutualrl.tasks.rewards import load_reward_function

__all__ = [
    "SUCCESS_THRESHOLD",
    "FileSource",
    "GymSource",
    "Problem",
    "Source",
    "Task",
    "available_datasets",
    "check_dataset",
    "extract_answer",
    "load_reward_function",
    "problem_id",
]
