"""Errors that tell the user what to do next.

Every error the library raises on bad input is one of these. Each message names what was wrong
and the fix, because the people who hit them are often 30 minutes into a compile on an
expensive instance.
"""

from __future__ import annotations

from collections.abc import Iterable


class Gemma4LibError(Exception):
    """Base class: anything the user can fix."""


class UnknownNameError(Gemma4LibError, ValueError):
    def __init__(self, kind: str, value: object, choices: Iterable[str]):
        choices = list(choices)
        super().__init__(f"unknown {kind} {value!r}; choose one of: {', '.join(choices)}")
        self.kind, self.value, self.choices = kind, value, choices


class PromptTooLongError(Gemma4LibError, ValueError):
    """Prompt + new tokens do not fit the compiled context; raised before any device work."""

    def __init__(
        self, prompt_tokens: int, max_new_tokens: int, context_length: int, draft_tokens: int = 0, media_tokens: int = 0
    ):
        drafts = f" + {draft_tokens} draft slots a verify writes ahead" if draft_tokens else ""
        of_media = f", {media_tokens} of them image or audio soft tokens," if media_tokens else ""
        fewer = " (or send fewer images or shorter clips)" if media_tokens else ""
        message = (
            f"prompt ({prompt_tokens} tokens{of_media}) + max_new_tokens ({max_new_tokens}){drafts} need "
            f"{prompt_tokens + max_new_tokens - 1 + draft_tokens} K/V positions (the last new token is never fed "
            f"back), more than the compiled context length {context_length}; "
            f"shorten the prompt{fewer}, lower max_new_tokens, or recompile with a larger context_length"
        )
        super().__init__(message)
        self.prompt_tokens, self.max_new_tokens, self.context_length = (prompt_tokens, max_new_tokens, context_length)


class SettingsError(Gemma4LibError, ValueError):
    """A setting of the wrong type or out of range (e.g. max_new_tokens=0), refused before any work."""


class GraphFormError(Gemma4LibError, ValueError):
    """A graph, tensor or layout of the wrong form handed to a step that needs another (e.g. the
    in-place graph to a functional compiler); the message names the form to build."""


class BadPromptError(Gemma4LibError, ValueError):
    pass


class ImageInputError(Gemma4LibError, ValueError):
    """An image that cannot be read: a missing file, or one that is not an image."""


class AudioInputError(Gemma4LibError, ValueError):
    """A clip that cannot be heard: not a 16 kHz 16-bit WAV, over 30 s, or too short."""


class NoVisionError(Gemma4LibError, ValueError):
    """Images for a checkpoint (or compiled engine) without a vision part."""


class TooManyImagesError(Gemma4LibError, ValueError):
    """More images than image tokens (image parts) in the prompt, or the other way round."""


class BatchTooLargeError(Gemma4LibError, ValueError):
    pass


class TensorParallelError(Gemma4LibError, ValueError):
    pass


class DeviceMemoryError(Gemma4LibError, ValueError):
    """A configuration whose weights, K/V and working memory do not fit the device (or the compile
    host); raised by `backends.preflight`, before anything is loaded."""


class CheckpointError(Gemma4LibError, ValueError):
    """A checkpoint folder or hub id that cannot be used as it is."""


class GatedCheckpointError(CheckpointError):
    """The hub answered, but the gated repository needs a token (or an account with access)."""


class HubUnreachableError(CheckpointError):
    """No connection to the hub (no network, or offline mode) and the checkpoint is not cached."""


class MissingChatTemplateError(CheckpointError):
    """A tokenizer without a chat template asked to encode a chat prompt: as plain text the model
    would see no turn markers and answer nonsense that the device reproduces faithfully."""


class NotGemma4Error(CheckpointError):
    pass


class VariantMismatchError(CheckpointError):
    """A Gemma-4 config whose features (PLE, KV sharing, k_eq_v, MoE) are not the chosen variant's."""


class EnvironmentMismatchError(Gemma4LibError, RuntimeError):
    """A package is missing or at a version other than the one this cookbook pins."""


class NeuronSDKMissingError(EnvironmentMismatchError, ImportError):
    """A Neuron-only entry point was called where the Neuron SDK is not installed."""


class ArtifactError(Gemma4LibError, RuntimeError):
    """A cached compile artifact is unusable (corrupt, half-written); it is rebuilt."""


class CacheLocationError(Gemma4LibError, RuntimeError):
    """The artifact cache folder cannot be used (a file, read-only, not creatable, full); the
    message names GEMMA4LIB_CACHE and how to point it somewhere usable."""


class CacheSpaceError(CacheLocationError):
    """Too little free space (or no inodes) for the package about to be compiled; raised before the
    compile, not as an abort while it is written."""


class CacheLockError(Gemma4LibError, TimeoutError):
    """Another process has held a cache key's build lock for longer than the wait limit."""


class BundleError(Gemma4LibError, ValueError):
    """An exported bundle (`python -m gemma4lib export`) that does not fit this run: another
    variant, shapes, TP degree, checkpoint or package versions; raised before any device work."""


class BaselineError(Gemma4LibError, ValueError):
    pass


class DeviceOutputError(Gemma4LibError, RuntimeError):
    """A compiled module's first call returned something other than the logits the host loop
    expects (another type, or the K/V copied back to the host every step)."""


class RankProcessError(Gemma4LibError, RuntimeError):
    """A CPU tensor-parallel rank process failed, exited or timed out (its traceback is in the message);
    every rank of that compile is stopped."""


class HostTablesMovedError(Gemma4LibError, RuntimeError):
    """The host embedder's tables are no longer usable host tensors after the compile or load
    (moved to a device or freed), so the next lookup would fail or run off the host."""


class NeuronCoresBusyError(Gemma4LibError, RuntimeError):
    """A model is already loaded on these NeuronCores and still referenced: loading a second copy
    would need twice the device memory."""


class LowHostMemoryWarning(UserWarning):
    """Host RAM is below the estimated peak of the compile about to start (it may be killed)."""
