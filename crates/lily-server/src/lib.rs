//! placeholder: the OpenAI-compatible server (issue 5).
