"""The most bytes a request body may hold, and the ASGI middleware that refuses more with 413.

    app.add_middleware(BodyLimit, max_bytes=default_max_request_bytes(engine), refused=refused)

A body is refused from its Content-Length before any of it is read, and, without one (chunked
transfer encoding), as soon as the bytes read pass the limit; the middleware reads the body (at
most max_bytes held) before the app sees it, and hands it on whole.
"""

from __future__ import annotations

TEXT_BYTES_PER_TOKEN = 64  # JSON text per context token, generously: a prompt's ids or words run 4 to 8
MIN_TEXT_BYTES = 1 << 20   # a body of 1 MiB is always allowed (a short context's chat history, metadata)
MIN_IMAGE_BYTES = 16 << 20  # images may come larger than the processor keeps (resized down): a photo or two


def default_max_request_bytes(cache_size: int, image_processor=None) -> int:
    """The default of --max_request_bytes for a context of `cache_size` tokens: 64 bytes a token (at
    least 1 MiB) for a text model; for a vision-language one (image_processor, zaya_jax.data.vision.
    processor.ImageProcessor) the base64 of an RGB image filling the context, 4 bytes a pixel and
    (patch_size x merge_size)^2 pixels a token, at least 16 MiB."""
    if image_processor is None:
        return max(MIN_TEXT_BYTES, TEXT_BYTES_PER_TOKEN * cache_size)
    side = image_processor.patch_size * image_processor.merge_size
    return max(MIN_IMAGE_BYTES, 4 * side * side * cache_size)


def too_large(max_bytes: int, given: str) -> str:
    return (f"the request body is {given}, more than this server's limit of {max_bytes} bytes; send less "
            "(or start the server with a larger --max_request_bytes)")


class BodyLimit:
    """ASGI middleware: an HTTP request's body of more than `max_bytes` is a 413, the ASGI response
    `refused(413, message)`."""

    def __init__(self, app, max_bytes: int, refused):
        self.app, self.max_bytes, self.refused = app, max_bytes, refused

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        length = dict(scope["headers"]).get(b"content-length", b"").decode("latin-1")
        if length.isdigit() and int(length) > self.max_bytes:
            return await self.refused(413, too_large(self.max_bytes, f"{int(length)} bytes"))(scope, receive, send)
        parts, read, more = [], 0, True
        while more:  # the body, read here up to the limit: the app gets it whole
            message = await receive()
            if message["type"] != "http.request":  # the client went away
                return
            parts.append(message.get("body", b""))
            read += len(parts[-1])
            if read > self.max_bytes:
                return await self.refused(413, too_large(self.max_bytes, f"at least {read} bytes"))(scope, receive,
                                                                                                    send)
            more = message.get("more_body", False)
        given = False

        async def replayed():
            nonlocal given
            if given:
                return await receive()
            given = True
            return {"type": "http.request", "body": b"".join(parts), "more_body": False}
        await self.app(scope, replayed, send)
