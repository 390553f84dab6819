"""OpenAI's Responses API over the engine: requests and responses (``types``), input items and
conversations (``items``), stream events (``events``), stored responses (``store``), pinned
conversation prefixes (``pins``) and the ``Responder`` that runs them (``service``).

    from sdk import AsyncClient
    response = await client.respond("Hi", instructions="Answer briefly.")
    follow_up = await client.respond("And then?", previous_response_id=response.id)
"""

from sdk.responses.config import ResponsesConfig
from sdk.responses.types import Response, ResponseEvent, ResponseRequest

__all__ = ["Response", "ResponseEvent", "ResponseRequest", "ResponsesConfig"]
