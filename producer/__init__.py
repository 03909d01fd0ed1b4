"""The mlxq producer library: hand generation work to mlxq workers through Redis."""

from ..shared.apikeys import AuthError
from ..shared.protocol import JobRefused, OverloadError

from .aclient import AsyncClient, AsyncJob
from .client import Client, Job
from .errors import ClientClosed, EmbeddingFailed, JobNotFound, JobTimeout, NoModelError, QuotaExceeded

__all__ = ["Client", "AsyncClient", "Job", "AsyncJob", "OverloadError", "AuthError", "JobRefused",
           "JobTimeout", "JobNotFound", "ClientClosed", "NoModelError", "EmbeddingFailed", "QuotaExceeded"]
