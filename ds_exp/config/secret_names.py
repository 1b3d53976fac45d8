"""Which names hold credentials: config keys (`logger.wandb.api_key`), keys of a DeepSpeed JSON (`comet.api_key`) and
environment variables (`HF_TOKEN`). A name is cut into words (`_ - .`, camelCase, digits) and judged word by word, never
by substring (`patience`, `tokenizer`, `max_new_tokens` are not secrets): words that name a credential anywhere
(password, secret, auth, pat, ...; and words ending in one: `dbpassword`); nouns that are credentials only at the end
(`api_key`, `hf_token`, not `pad_token`, `sort_key`, `PWD`); their plurals only after a qualifier (`api_keys`, not
`max_tokens`); one word running a qualifier and a noun together (`apitoken`, `wandbkey`, not `monkey`, `eostoken`); and
a descriptor after the credential word makes it about the credential (`password_file`, `api_key_env`). Wrongly calling a
name secret costs little, missing one leaks it: an unknown qualifier (`acme_token`) counts. No third-party imports."""

from __future__ import annotations

import re


def _set(words: str) -> frozenset[str]:
    return frozenset(words.split())


# a credential wherever the word stands (unless a descriptor follows it)
CREDENTIAL_WORDS = _set(
    """secret secrets password passwords passwd passphrase passcode passkey credential credentials creds cred auth
    oauth authorization bearer cookie cookies pat private privkey apikey signature dsn jwt otp totp"""
)
# one word ending in a credential: `dbpassword`, `clientsecret`, `openaiapikey`, `authtoken`
_COMPOUND = re.compile(r"(password|passwd|secret|apikey|accesskey|secretkey|privatekey|authtoken|accesstoken)$")
# what makes a key or a token (or their plurals) a credential: its kind, or the service it opens
QUALIFIERS = _set(
    """api access auth oauth refresh secret private bearer session client service personal deploy deployment bot app
    id signing encryption master root admin ssh gpg pgp webhook license account storage upload
    hf hub huggingface github gh gitlab gl wandb openai anthropic claude slack discord aws azure gcp google gcs s3
    stripe twilio sendgrid mlflow comet neptune cohere mistral groq replicate pinecone datadog sentry npm pypi docker
    dockerhub telegram notion jira mailgun heroku vercel cloudflare dropbox kaggle together deepseek gemini"""
)
# the credential nouns a one-word name may end in after its qualifiers: `githubtoken`, `wandbkey`, `apikeys`
_RUN_TOGETHER = ("tokens", "token", "keys", "key", "pat")
# credential nouns at the end of a name, with the words before them that make them something else
NOUN_QUALIFIERS: dict[str, frozenset[str]] = {
    "key": _set(
        """sort text prompt chosen rejected response completion message messages conversation column field data
        dataset cache hash dict map group label input output name metric role content image primary foreign
        partition lookup index join sample split feature sequence state config checkpoint trajectory module param
        parameter layer model result sweep choice override lock row record item entry unique shard job run task
        query attention kv instruction question answer context history chat template source target monitor dedup
        order resume study trial objective experiment"""
    ),
    "token": _set(
        """pad eos bos unk sep cls mask end start begin stop special conversation eot eom image audio video tool
        think chat system user assistant default added extra placeholder first last next prefix suffix turn
        separator vocab decoder generation response prompt fill middle fim boundary control reserved role
        instruction answer question new output text max min num total count per"""
    ),
    "session": _set("desktop xdg term terminal tmux screen login shell training"),
    "sig": frozenset(),
    "pass": _set("first second third forward backward multi single one two"),
    "pwd": frozenset(),
}
# what may follow a credential noun and keep it the credential: `api_key_value`, `session_id`
VALUE_WORDS = _set("value string str b64 base64 hex bytes raw id")
# what makes the name about a credential rather than the credential itself
DESCRIPTORS = _set(
    """name names path paths file files filename dir directory folder type types mode method kind env var variable
    enabled enable disabled required source count counts num len length lengths size sizes url uri host port
    endpoint server sock socket timeout ttl expiry expires format field column prefix provider scope scopes location
    manager helper command cmd"""
)

_CAMEL = re.compile(r"(?<=[a-z0-9])(?=[A-Z])|(?<=[A-Z])(?=[A-Z][a-z])")


def _qualifiers_only(prefix: str) -> bool:
    """`prefix` is one or more QUALIFIERS run together: `github`, `hfhub`, `openaiapi` (not `mon` of `monkey`)."""
    ends = {0}
    for end in range(1, len(prefix) + 1):
        if any(start in ends and prefix[start:end] in QUALIFIERS for start in range(max(0, end - 12), end)):
            ends.add(end)
    return len(prefix) in ends and bool(prefix)


def _run_together(word: str) -> bool:
    """One word that is a credential: `dbpassword`, `githubtoken`, `wandbkey`, `apikeys`, `acmetoken`, `sessionid`."""
    if _COMPOUND.search(word):
        return True
    for value in VALUE_WORDS:  # `sessionid`, `apikeyvalue`: the credential, said of its value
        stem = word.removesuffix(value)
        if stem != word and (stem in CREDENTIAL_WORDS or stem in NOUN_QUALIFIERS or (stem and _run_together(stem))):
            return True
    for noun in _RUN_TOGETHER:
        if word.endswith(noun) and word != noun:
            prefix = word[: -len(noun)]
            if _qualifiers_only(prefix):
                return True
            # no English word ends in "token": what precedes it names a credential unless it names a vocabulary
            # token (`eostoken`, `maxtoken`)
            if noun == "token" and not any(prefix.endswith(q) for q in NOUN_QUALIFIERS["token"]):
                return True
    return False


def is_secret_name(name: object) -> bool:
    """Whether a key or environment variable named `name` holds a credential (see the module docstring)."""
    words = re.findall(r"[a-z]+", _CAMEL.sub("_", str(name)).lower())  # `mlflowTrackingPassword`, `HF_TOKEN2`
    for i, word in enumerate(words):
        rest = words[i + 1 :]
        if any(r in DESCRIPTORS for r in rest):
            continue
        if word in CREDENTIAL_WORDS or _run_together(word):
            return True
        if word in ("keys", "tokens") and i > 0 and words[i - 1] in QUALIFIERS and all(r in VALUE_WORDS for r in rest):
            return True  # `api_keys`, `auth_tokens`: never `max_tokens`, `sort_keys`
        qualifiers = NOUN_QUALIFIERS.get(word)
        if qualifiers is None or not all(r in VALUE_WORDS for r in rest):
            continue
        if word == "pwd" and len(words) == 1:  # $PWD, the working directory
            continue
        if i == 0 or words[i - 1] not in qualifiers:
            return True
    return False
