"""``GET /v1/models`` and ``GET /v1/models/{model}``: the names clients pass as ``model``."""

from __future__ import annotations

from fastapi import APIRouter

from . import protocol as P
from .state import State

router = APIRouter(prefix="/v1")


@router.get("/models")
async def list_models(st: State) -> dict:
    return {"object": "list", "data": [P.model_card(n, st.model_root, st.max_model_len, st.created)
                                       for n in st.served_model_names]}


@router.get("/models/{model:path}")
async def get_model(model: str, st: State) -> dict:
    st.check_model(model)
    return P.model_card(model, st.model_root, st.max_model_len, st.created)
