"""POST /v1/embeddings (OpenAI's route): the vectors of texts or token ids from the embedding model the request
names (`model`; an unknown one is a 404 as OpenAI's), as floats or base64 (little-endian float32, as OpenAI's
SDK decodes it). The models are in `app.state.embedders` (server/embedders.py)."""

from __future__ import annotations

import base64

import numpy as np
from fastapi import APIRouter, Request, Response

from pagedllm.server.embedders import Embedder
from pagedllm.server.errors import ERROR_RESPONSES, APIError
from pagedllm.server.protocol_embedding import EmbeddingData, EmbeddingRequest, EmbeddingResponse, EmbeddingUsage
from pagedllm.server.serving_engine import cancel_on_disconnect, json_response, request_id

router = APIRouter()


def pick_embedder(embedders: list[Embedder], model: str | None) -> tuple[Embedder, str]:
    """The embedder serving `model` (the first one when the request names none) and the name it answers with."""
    if not embedders:
        raise APIError("This server serves no embedding model (start it with --embedding-model)", 404, param="model")
    if model is None:
        return embedders[0], embedders[0].names[0]
    for e in embedders:
        if model in e.names:
            return e, model
    names = ", ".join(n for e in embedders for n in e.names)
    raise APIError(f"The model `{model}` does not exist. Available embedding models: {names}", 404, param="model")


def _encoded(vec: list[float], encoding_format: str) -> list[float] | str:
    if encoding_format == "base64":
        return base64.b64encode(np.asarray(vec, dtype="<f4").tobytes()).decode("ascii")
    return vec


async def _answer(req: EmbeddingRequest, embedder: Embedder, name: str, rid: str, budget: int) -> EmbeddingResponse:
    vectors, tokens = await embedder.embed(req.inputs(), req.dimensions, rid, req.truncate_prompt_tokens, budget)
    data = [
        EmbeddingData(object="embedding", index=i, embedding=_encoded(v, req.encoding_format))
        for i, v in enumerate(vectors)
    ]
    usage = EmbeddingUsage(prompt_tokens=tokens, total_tokens=tokens)
    return EmbeddingResponse(object="list", data=data, model=name, usage=usage)


@router.post("/v1/embeddings", response_model=EmbeddingResponse, responses={**ERROR_RESPONSES})
async def create_embedding(req: EmbeddingRequest, request: Request) -> Response:
    """Embed each input alone; every check (model, inputs, lengths, dimensions) before any work starts."""
    embedder, name = pick_embedder(request.app.state.embedders, req.model)
    rid = request_id(request, None, "embd")
    budget = request.app.state.max_embedding_tokens
    return json_response(await cancel_on_disconnect(request, _answer(req, embedder, name, rid, budget)))
