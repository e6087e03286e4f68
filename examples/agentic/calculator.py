"""A calculator tool-use task: the model may call the tool, then answers with the result.

Each prompt is a single-digit addition (`train.jsonl`: `{"prompt": "3+4=", "label": "7"}`).
An episode has up to two model turns:

1. the model writes up to `TURN_TOKENS` tokens; writing `#` calls the calculator, which
   ends the turn there (a stop string, kept in the text);
2. the calculator answers with the sum and a newline (environment tokens: in the context,
   out of the loss), and the model writes its answer.

Without a call the first turn is the answer. The reward scores the answer's characters:
1 for each that is the right sum, 0.25 for any other digit, averaged over `TURN_TOKENS`
(dense credit, so a tiny model's first GRPO groups have reward variance). After a call the
sum sits right before the answer, so calling the tool is how the answer gets easy.

    --custom-generate-function-path examples.agentic.calculator.generate
    --custom-rm-path examples.agentic.calculator.reward
"""

from __future__ import annotations

from functools import lru_cache
from typing import Any

from slime_like.models.chat_template import TINY_CHAT_TEMPLATE
from slime_like.models.hf_tokenizer import load_tokenizer
from slime_like.models.tokenizer import ByteTokenizer
from slime_like.rollout.generate import Sample
from slime_like.rollout.multiturn import Episode, run_episode

TOOL_CALL = "#"
TURN_TOKENS = 4
MAX_TURNS = 2
TOOL_BONUS = 0.5


def evaluate(prompt: str) -> int:
    """The calculator: `a+b=` -> a + b (the only expressions this task asks about)."""
    a, b = prompt.rstrip().rstrip("=").split("+")
    return int(a) + int(b)


def calculator(sample: Sample, episode: Episode) -> str | None:
    """The environment: the tool's answer when the model's last turn called it, else the
    episode ends."""
    if TOOL_CALL not in episode.last.text:
        return None
    return f"{evaluate(sample.prompt)}\n"


@lru_cache(maxsize=4)
def _tokenizer(checkpoint: str | None):
    if checkpoint:
        return load_tokenizer(checkpoint, add_special_tokens=False)
    return ByteTokenizer(chat_template=TINY_CHAT_TEMPLATE)


def turn_sampling(sampling_params: dict[str, Any]) -> dict[str, Any]:
    """The job's sampling, per turn: a few tokens, a tool call ends the turn and stays."""
    return {**sampling_params, "max_new_tokens": TURN_TOKENS, "stop": [TOOL_CALL],
            "no_stop_trim": True}


async def generate(args: Any, sample: Sample, sampling_params: dict[str, Any], *,
                   router_url: str, api_key: str | None = None, **kwargs: Any) -> Sample:
    """slime's custom generate function: one calculator episode through the router."""
    return await run_episode(sample, router_url=router_url,
                             sampling_params=turn_sampling(sampling_params),
                             env_step=calculator, tokenizer=_tokenizer(args.hf_checkpoint),
                             max_turns=MAX_TURNS, api_key=api_key)


def answer_credit(answer: str, label: str) -> float:
    """1 per character equal to the label, 0.25 per other digit, over TURN_TOKENS."""
    score = sum(1.0 if ch == label else 0.25 if ch.isdigit() else 0.0
                for ch in answer[:TURN_TOKENS])
    return score / TURN_TOKENS


def reward(args: Any, sample: Sample, **kwargs: Any) -> float:
    """The answer's credit (the last model turn; the first, if the tool was not called),
    plus TOOL_BONUS for an episode that used the calculator."""
    answer = sample.meta["turn_texts"][-1]
    credit = answer_credit(answer.replace(TOOL_CALL, ""), str(sample.label))
    return credit + (TOOL_BONUS if called_tool(sample) else 0.0)


def called_tool(sample: Sample) -> bool:
    """Whether the episode called the calculator (it then has environment tokens)."""
    return sample.loss_mask is not None and 0 in sample.loss_mask
