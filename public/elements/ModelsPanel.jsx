// The models panel (props from app/web/models_panel.py): the models of the weights folder, what can be done
// with each, and a field to pull one, with each pull's progress. A click is the action "models", answered by
// the server, which sends the props again.
import { useState } from 'react';

const BUTTON = 'rounded-md border px-2 py-1 text-xs hover:bg-accent disabled:opacity-50';
const DANGER = 'rounded-md border border-red-500 px-2 py-1 text-xs text-red-600 hover:bg-red-50';

function Model({ model, admin, act }) {
  const [confirming, setConfirming] = useState(false);
  const marks = [model.default && 'default', model.current && 'this chat', model.loaded ? (model.memory ? `loaded, ${model.memory}` : 'loaded') : 'not loaded']
    .filter(Boolean).join(' · ');
  return (
    <div className="models-row flex flex-wrap items-center justify-between gap-2 border-b py-2" data-model={model.name}>
      <div className="min-w-0">
        <div className="font-medium">{model.name}</div>
        <div className="text-xs text-muted-foreground">
          {model.details}{model.context ? ` · context ${model.context} tokens` : ''}
        </div>
        <div className="models-marks text-xs text-muted-foreground">{marks}</div>
      </div>
      <div className="flex gap-1">
        {!model.current && <button className={BUTTON} onClick={() => act({ do: 'use', name: model.name })}>Use</button>}
        {admin && model.loaded &&
          <button className={BUTTON} onClick={() => act({ do: 'unload', name: model.name })}>Unload</button>}
        {admin && !model.default &&
          <button className={BUTTON} onClick={() => act({ do: 'default', name: model.name })}>Make default</button>}
        {admin && !model.default && !model.in_place && !confirming &&
          <button className={BUTTON} onClick={() => setConfirming(true)}>Remove</button>}
        {confirming && <>
          <span className="text-xs">Remove {model.name} from disk{model.loaded ? ' (it is unloaded first)' : ''}?</span>
          <button className={DANGER} onClick={() => { setConfirming(false); act({ do: 'remove', name: model.name }); }}>
            Remove</button>
          <button className={BUTTON} onClick={() => setConfirming(false)}>Keep</button>
        </>}
      </div>
    </div>
  );
}

function Progress({ pull, admin, act }) {
  const share = pull.total ? Math.min(100, (100 * pull.done) / pull.total) : 0;
  const words = [pull.total_text ? `${pull.done_text} of ${pull.total_text}` : pull.done_text, pull.speed, pull.left,
    pull.file].filter(Boolean).join(' · ');
  return (
    <div className="models-pull my-2" data-source={pull.source}>
      <div className="flex items-center justify-between text-sm">
        <span>Pulling {pull.source}</span>
        {admin && <button className={BUTTON} onClick={() => act({ do: 'cancel', source: pull.source })}>Cancel</button>}
      </div>
      <div className="h-2 w-full rounded bg-muted">
        <div className="models-bar h-2 rounded bg-primary" style={{ width: `${share}%` }} />
      </div>
      <div className="models-progress text-xs text-muted-foreground">{words || 'asking the hub for the files…'}</div>
    </div>
  );
}

export default function ModelsPanel() {
  const [source, setSource] = useState('');
  const act = (payload) => callAction({ name: 'models', payload });
  const pull = (what) => { if (what.trim()) { act({ do: 'pull', source: what.trim() }); setSource(''); } };
  return (
    <div className="models-panel w-full max-w-2xl rounded-lg border p-3 text-sm">
      {props.note && <p className="models-note mb-2">{renderNote(props.note)}</p>}
      {props.models.map((model) => <Model key={model.name} model={model} admin={props.admin} act={act} />)}
      {(props.unusable || []).map((u) => (
        <div key={u.name} className="models-unusable py-1 text-xs text-muted-foreground">
          {u.name} ({u.store}): cannot be used here: {u.why}
        </div>
      ))}
      {props.pulls.map((p) => <Progress key={p.source} pull={p} admin={props.admin} act={act} />)}
      {props.interrupted.map((i) => (
        <div key={i.source} className="models-interrupted flex items-center justify-between gap-2 py-1">
          <span>{i.source} <span className="text-xs text-muted-foreground">(interrupted, {i.here} here)</span></span>
          {props.admin && <button className={BUTTON} onClick={() => pull(i.source)}>Resume</button>}
        </div>
      ))}
      {props.admin ? (
        <div className="mt-3">
          {props.suggestions.map((s) => (
            <div key={s.repo} className="models-suggestion flex items-center justify-between gap-2 py-1">
              <span>{s.repo} <span className="text-xs text-muted-foreground">({s.size}, {s.memory}; {s.account}
                {s.fits_disk ? '' : '; not enough free disk'})</span></span>
              <button className={BUTTON} disabled={!s.fits_disk} onClick={() => pull(s.repo)}>Pull</button>
            </div>
          ))}
          <form className="mt-2 flex gap-2" onSubmit={(e) => { e.preventDefault(); pull(source); }}>
            <input className="models-source flex-1 rounded-md border bg-background px-2 py-1" value={source}
              placeholder="Hugging Face id (owner/name[:revision or :Q4_K_M]) or the path of a .gguf file or folder"
              onChange={(e) => setSource(e.target.value)} />
            <button className={BUTTON} type="submit">Pull</button>
          </form>
        </div>
      ) : <p className="mt-2 text-xs text-muted-foreground">Only the server's model admins may pull or remove models.</p>}
      {props.said && <p className="models-said mt-2" style={{whiteSpace: 'pre-line'}}>{props.said}</p>}
    </div>
  );
}

function renderNote(note) {  // **bold** only
  return note.split('**').map((part, i) => (i % 2 ? <b key={i}>{part}</b> : part));
}
