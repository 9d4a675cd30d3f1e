// The files of a user message as a row of chips: name, and kind, pages and size (props.files, from
// app/web/attachments.py). A PDF's chip opens the PDF beside the chat; another file's downloads it.
import { elementState, sideViewState } from '@chainlit/react-client';
import { FileText } from 'lucide-react';
import { useRecoilValue, useSetRecoilState } from 'recoil';

const CHIP = 'file-chip inline-flex items-center gap-2 max-w-[16rem] rounded-lg border bg-card px-3 py-1.5 ' +
  'text-left no-underline hover:bg-accent';

function Chip({ file, upload, open }) {
  const body = (
    <>
      <FileText className="h-5 w-5 shrink-0 text-muted-foreground" />
      <span className="flex min-w-0 flex-col">
        <span className="truncate text-sm font-medium">{file.name}</span>
        <span className="truncate text-xs text-muted-foreground">{file.details}</span>
      </span>
    </>
  );
  if (upload?.url && upload.type === 'pdf') {
    return <button type="button" className={CHIP} title={`Show ${file.name}`} onClick={() => open(upload)}>{body}</button>;
  }
  if (upload?.url) {
    return <a className={CHIP} href={upload.url} download={file.name} title={`Download ${file.name}`}>{body}</a>;
  }
  return <span className={CHIP}>{body}</span>;
}

export default function FileChips() {
  const elements = useRecoilValue(elementState);
  const setSideView = useSetRecoilState(sideViewState);
  const open = (upload) => setSideView({ title: upload.name, elements: [{ ...upload, display: 'side' }] });
  return (
    <div className="file-chips flex flex-wrap justify-end gap-2">
      {props.files.map((file) => (
        <Chip key={file.element} file={file} upload={elements.find((e) => e.id === file.element)} open={open} />
      ))}
    </div>
  );
}
