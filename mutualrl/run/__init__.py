"""Driving a run: the trainer's step loop, the policy workers it drives, their checkpoints and
resume, data-parallel ranks (``torch.distributed``, FSDP), devices, progress, metrics tracking and
fault injection for the crash tests."""
