"""dsv41: a workbench for the DeepSeek-V4.1-Flash checkpoint."""

__version__ = "0.1.0"
