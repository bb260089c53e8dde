"""Checks on quantized checkpoints exported in ModelOpt's unified Hugging Face format."""

from modelopt_ext.export.verify import MANIFEST_NAME, ExportInvalid, VerifyReport, verify_export

__all__ = ["MANIFEST_NAME", "ExportInvalid", "VerifyReport", "verify_export"]
